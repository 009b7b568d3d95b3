"""Job queues on disk: <state>/train/jobs/<id>/ (training), <state>/eval/jobs/<id>/ (evaluation),
<state>/openenv/jobs/<id>/ (OpenEnv runs).

Each job folder holds `job.json` (spec and status; written only by the trainer, atomically),
`losses.jsonl` (one line per optimizer step), `checkpoint.npz`, and a `cancel` marker that
anyone (the supervisor) may create. The supervisor reads the store directly, so `kiln train
status` answers even while the trainer is busy or restarting; the trainer is the only writer
of job.json, so no update is lost between processes.

States: queued → running → completed | failed | cancelled; running → paused when the trainer
stops (kiln down, SIGTERM) — a paused or running job is resumed first when the trainer starts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FINAL = ("completed", "failed", "cancelled")


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JobNotFound(KeyError):
    pass


class JobStore:
    def __init__(self, state_dir: str | os.PathLike, kind: str = "train"):
        self.kind = kind
        self.prefix = "job" if kind == "train" else kind         # job-0001, eval-0001, openenv-0001
        self.root = Path(state_dir) / kind / "jobs"

    def _dir(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise JobNotFound(job_id)
        return self.root / job_id

    def create(self, spec: dict, **fields) -> dict:
        self.root.mkdir(parents=True, exist_ok=True)
        n = 1 + max((int(p.name.split("-")[1]) for p in self.root.glob(f"{self.prefix}-*")
                     if p.name.split("-")[1].isdigit()), default=0)
        while True:
            job_id = f"{self.prefix}-{n:04d}"
            try:
                (self.root / job_id).mkdir()
                break
            except FileExistsError:
                n += 1
        job = {"id": job_id, "kind": self.kind, "state": "queued", "created": time.time(), "spec": spec,
               "started": None, "finished": None, "error": None, **fields}
        write_json_atomic(self.root / job_id / "job.json", job)
        return job

    def get(self, job_id: str) -> dict:
        try:
            job = json.loads((self._dir(job_id) / "job.json").read_text())
        except (OSError, ValueError):
            raise JobNotFound(job_id) from None
        job["cancel_requested"] = (self._dir(job_id) / "cancel").exists()
        return job

    def list(self) -> list[dict]:
        if not self.root.is_dir():
            return []
        jobs = []
        for p in sorted(self.root.glob(f"{self.prefix}-*")):
            try:
                jobs.append(self.get(p.name))
            except JobNotFound:
                continue                      # a folder being created
        return jobs

    def save(self, job: dict) -> None:
        job = {k: v for k, v in job.items() if k != "cancel_requested"}
        write_json_atomic(self._dir(job["id"]) / "job.json", job)

    def request_cancel(self, job_id: str) -> dict:
        job = self.get(job_id)
        if job["state"] not in FINAL:
            (self._dir(job_id) / "cancel").touch()
            job["cancel_requested"] = True
        return job

    def clear_cancel(self, job_id: str) -> None:
        """A job resumed after a cancel (an OpenEnv run) runs again."""
        (self._dir(job_id) / "cancel").unlink(missing_ok=True)

    def cancel_requested(self, job_id: str) -> bool:
        return (self._dir(job_id) / "cancel").exists()

    def next_job(self) -> dict | None:
        """An interrupted job first (running or paused), else the oldest queued one."""
        jobs = self.list()
        for states in (("running", "paused"), ("queued",)):
            for job in jobs:
                if job["state"] in states:
                    return job
        return None

    def losses(self, job_id: str, since: int = 0) -> list[dict]:
        try:
            lines = (self._dir(job_id) / "losses.jsonl").read_text().splitlines()
        except OSError:
            return []
        out = []
        for ln in lines:
            try:
                rec = json.loads(ln)
            except ValueError:
                continue                       # a line being written
            if rec["step"] > since:
                out.append(rec)
        return out

    def path(self, job_id: str, name: str) -> Path:
        return self._dir(job_id) / name
