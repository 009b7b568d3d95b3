"""OpenEnv runs the daemon owns (`POST /v1/openenv/runs`), played by the evaluator worker: the
CLI's `kiln openenv train` as a job that outlives the client that asked for it.

A run goes through phases, each recorded in its job before it starts, so a run interrupted at
any point — the evaluator killed, `kiln down`, a cancel — resumes where it was:

    rollout  groups × group size episodes into <job>/rollout (protocol/openenv/rollout.py); a
             resumed rollout keeps its whole episodes and plays on from the next one
    train    (with an adapter name) GRPO on the groups' returns, a job of the trainer's, which
             this run waits on; a resumed run waits on the same training job
    eval     (with an adapter and eval_seeds) the base model and the adapter on held-out seeds,
             per-seed mean returns and the sign test (evaluation.json)

Jobs live in <state>/openenv/jobs/openenv-NNNN/ (job.json, the run folders); the supervisor reads
them for status. The environment server is untrusted: everything it says is checked in
protocol/openenv/env.py, here, in a worker — never in the supervisor.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from kiln.native.eval_metrics import compare_returns
from kiln.protocol.openenv.env import Environment, EnvError
from kiln.protocol.openenv.rollout import RUN_FOLDERS, rollout
from kiln.protocol.store.adapter_registry import AdapterNotFound, check_name
from kiln.protocol.store.job_store import FINAL, JobNotFound, JobStore, write_json_atomic

from .worker import OpError

# the bounds `kiln openenv rollout` puts on its options (supervisor/cli/openenv.py)
BOUNDS = {"groups": (1, 10000), "group_size": (2, 64), "seed": (0, 2**31 - 1), "max_steps": (1, 1000),
          "max_tokens": (1, 8192), "eval_seeds": (0, 10000)}
DEFAULTS = {"groups": 4, "group_size": 4, "seed": 0, "max_steps": 8, "temperature": 1.0, "max_tokens": 256,
            "eval_seeds": 4}
TRAIN_OPTIONS = ("lr", "rank", "beta", "epochs")
RESUMABLE = ("failed", "cancelled")


def check_spec(body: dict) -> dict:
    """The run's settings with defaults filled in, or OpError bad_request naming the field."""
    spec = {"env": body["env"], **{k: body.get(k, v) for k, v in DEFAULTS.items()},
            "model": body.get("model"), "adapter": body.get("adapter"), "train": dict(body.get("train") or {})}
    try:
        Environment(spec["env"])
    except EnvError as e:
        raise OpError("bad_request", f"env: {e}") from None
    for k, (lo, hi) in BOUNDS.items():
        if not isinstance(spec[k], int) or isinstance(spec[k], bool) or not lo <= spec[k] <= hi:
            raise OpError("bad_request", f"{k}: {spec[k]!r} is not an integer in [{lo}, {hi}]")
    t = spec["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 4.0:
        raise OpError("bad_request", f"temperature: {t!r} is not a number in [0, 4]")
    unknown = set(spec["train"]) - set(TRAIN_OPTIONS)
    if unknown:
        raise OpError("bad_request", f"train: unknown option(s) {sorted(unknown)}; known: {', '.join(TRAIN_OPTIONS)}")
    if spec["train"] and not spec["adapter"]:
        raise OpError("bad_request", "train: options for training, but no adapter to train (name one in adapter)")
    if spec["adapter"]:
        from kiln.native.training.sft_trainer import TrainSpec
        try:
            check_name(spec["adapter"])
        except ValueError as e:
            raise OpError("bad_request", f"adapter: {e}") from None
        try:
            TrainSpec.from_dict(spec["train"])
        except (ValueError, TypeError) as e:
            raise OpError("bad_request", f"training settings: {e}") from None
    return spec


class OpenEnvRuns:
    """The evaluator's OpenEnv jobs: submit, resume, and the loop's `run`."""

    def __init__(self, worker, state_dir: Path):
        self.worker = worker
        self.store = JobStore(state_dir, "openenv")
        self.train_store = JobStore(state_dir, "train")
        for job in self.store.list():            # interrupted by its evaluator's end: go on where it was
            if job["state"] == "running":
                job.update(state="queued", resumed=job.get("resumed", 0) + 1,
                           note="the evaluator stopped during the run; it goes on from its last whole episode")
                self.store.save(job)

    def submit(self, body: dict) -> dict:
        spec = check_spec(body)
        if spec["adapter"]:
            try:
                self.worker.adapters.get(spec["adapter"])
                raise OpError("adapter_exists", f"an adapter named {spec['adapter']!r} exists; choose another name")
            except AdapterNotFound:
                pass
        total = (spec["groups"] + (2 * spec["eval_seeds"] if spec["adapter"] else 0)) * spec["group_size"]
        return self.store.create(spec, phase="rollout", done=0, total=total, mean_return=None, train_job=None,
                                 evaluation=None, resumed=0)

    def resume(self, job_id: str) -> dict:
        try:
            job = self.store.get(str(job_id))
        except JobNotFound:
            raise OpError("job_not_found", f"no OpenEnv run {job_id!r}") from None
        if job["state"] not in RESUMABLE:
            raise OpError("bad_request", f"run {job['id']} is {job['state']}; only a "
                                         f"{' or '.join(RESUMABLE)} run can be resumed")
        self.store.clear_cancel(job["id"])
        job.update(state="queued", error=None, finished=None, resumed=job.get("resumed", 0) + 1, note=None)
        self.store.save(job)
        return job

    def next_queued(self) -> dict | None:
        return next((j for j in self.store.list() if j["state"] == "queued"), None)

    # -- running ----------------------------------------------------------------------------------

    def run(self, job: dict, stopping) -> None:
        jid, spec = job["id"], job["spec"]
        if self.store.cancel_requested(jid):     # cancelled while it waited: the environment is never touched
            job.update(state="cancelled", finished=time.time())
            return self.store.save(job)
        job.update(state="running", started=job.get("started") or time.time())
        self.store.save(job)

        def stop() -> str | None:
            if self.store.cancel_requested(jid):
                return "cancelled"
            return "the evaluator is stopping" if stopping.is_set() else None
        try:
            if job["phase"] == "rollout":
                s = self._rollout(job, "rollout", spec["groups"], spec["seed"], "", stop)
                job["mean_return"] = s["mean_return"]
                if s["error"] is None:
                    job["phase"] = "train" if spec["adapter"] else "done"
            if job["phase"] == "train" and stop() is None:
                self._train(job, stop)
            if job["phase"] == "eval" and stop() is None:
                self._evaluate(job, stop)
        except EnvError as e:
            job.update(state="failed", finished=time.time(),
                       error=f"{e}; what was recorded is kept: `kiln openenv resume {jid}` goes on from it")
            return self.store.save(job)
        except OpError as e:
            job.update(state="failed", finished=time.time(), error=f"{e.code}: {e.message}")
            return self.store.save(job)
        why = stop()
        if job["phase"] == "done":
            job.update(state="completed", finished=time.time())
        elif why == "cancelled":
            job.update(state="cancelled", finished=time.time())
        else:                                    # the evaluator stops: the next one goes on with it
            job.update(state="queued", note="the evaluator stopped during the run; it goes on from where it was")
        self.store.save(job)

    def _rollout(self, job: dict, name: str, groups: int, seed: int, adapter: str, stop) -> dict:
        spec, out = job["spec"], self.store.path(job["id"], name)
        resume = (out / "discovery.json").is_file()
        if out.exists() and not resume:          # created, then stopped before discovery was written
            shutil.rmtree(out)
        job["done"] = self._recorded(job["id"])

        def progress(_line: str) -> None:
            job["done"] += 1
            self.store.save(job)
        settings = {k: spec[k] for k in ("temperature", "max_tokens", "model")} | {"adapter": adapter}
        try:
            return rollout(Environment(spec["env"]), out, self._actor(spec, adapter), groups, spec["group_size"],
                           seed, spec["max_steps"], settings, progress, resume=resume, stop=stop)
        finally:
            job["done"] = self._recorded(job["id"])
            self.store.save(job)

    def _recorded(self, job_id: str) -> int:
        """Episodes written so far, over the run's rollout folders."""
        n = 0
        for name in RUN_FOLDERS:
            try:
                with open(self.store.path(job_id, name) / "transcript.jsonl", "rb") as f:
                    n += sum(1 for ln in f if ln.endswith(b"\n"))
            except OSError:
                pass
        return n

    def _actor(self, spec: dict, adapter: str):
        """act(messages, schema, seed) -> the model's action text: the daemon's generate with the
        action schema as its grammar ("" as the adapter: the base model)."""
        def act(messages, schema, seed):
            body = {"messages": messages, "grammar": {"json_schema": schema}, "adapter": adapter,
                    "params": {"temperature": spec["temperature"], "max_tokens": spec["max_tokens"], "seed": seed},
                    **({"model": spec["model"]} if spec["model"] else {})}
            text = []
            try:
                for m in self.worker.request_up("generate", body, timeout=600):
                    text.append(m.body.get("text", "") if isinstance(m.body, dict) else "")
            except OpError as e:
                raise EnvError(f"the model could not act: {e.code}: {e.message}") from None
            return "".join(text).strip()
        return act

    def _train(self, job: dict, stop) -> None:
        spec = job["spec"]
        if not job.get("train_job"):
            body = {"file": str(self.store.path(job["id"], "rollout") / "dataset.jsonl"), "adapter": spec["adapter"],
                    "method": "grpo", "options": spec["train"], **({"model": spec["model"]} if spec["model"] else {})}
            reply = [m for m in self.worker.request_up("train.submit", body, timeout=600)][-1]
            job["train_job"] = reply.body["id"]
            self.store.save(job)
        while True:
            try:
                t = self.train_store.get(job["train_job"])
            except JobNotFound:
                raise OpError("job_not_found", f"training job {job['train_job']} is gone") from None
            job["train_state"] = t["state"]
            if t["state"] == "completed":
                job["phase"] = "eval" if spec["eval_seeds"] else "done"
                return self.store.save(job)
            if t["state"] in FINAL:
                raise OpError("op_failed", f"training job {t['id']} {t['state']}: {t.get('error') or ''}".strip())
            if stop() is not None:
                if stop() == "cancelled":
                    try:
                        list(self.worker.request_up("train.cancel", {"id": t["id"]}, timeout=60))
                    except OpError:
                        pass                     # it finished meanwhile: the run is cancelled all the same
                return self.store.save(job)
            time.sleep(0.5)

    def _evaluate(self, job: dict, stop) -> None:
        spec = job["spec"]
        start = spec["seed"] + spec["groups"]
        runs = []
        for name, arm in (("eval-base", ""), ("eval-adapter", spec["adapter"])):
            s = self._rollout(job, name, spec["eval_seeds"], start, arm, stop)
            if s["error"] is not None:
                return self.store.save(job)
            runs.append(s)
        c = compare_returns(*runs)
        c["better"] = c["wins"] > c["losses"] and c["p_value"] <= 0.05
        write_json_atomic(self.store.path(job["id"], "evaluation.json"), c)
        job.update(evaluation={k: c[k] for k in ("base_mean", "adapter_mean", "wins", "losses", "ties", "p_value",
                                                 "better")}, phase="done")
        self.store.save(job)
