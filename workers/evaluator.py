"""The evaluator worker (kind `evaluator`): suites run against the served model, arms compared,
runs replayed byte for byte; and the OpenEnv runs the daemon owns (workers/openenv_runs.py).

It loads no weights: every completion is a `generate` request it sends up its own socket to the
supervisor's router (which checks it against the evaluator's allow-list, waits through restarts
of the inference worker and retries a request that produced nothing), one example at a time so
that a run is reproducible. Jobs live in the queue on disk (<state>/eval/jobs/<id>/: job.json, suite.json,
results.jsonl); the supervisor reads them for status.

Each run records its identities — the suite's hash, the model file's sha256, each adapter's
sha256, the full generation config — so `replay` can tell "the same inputs gave other bytes"
(mismatch) from "the inputs changed" (error). A job interrupted by the evaluator's death is
marked failed with that reason when the evaluator starts again.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import traceback
from pathlib import Path

from kiln.protocol.store.adapter_registry import AdapterNotFound, AdapterRegistry
from kiln.protocol.store.job_store import JobNotFound, JobStore, write_json_atomic

from kiln.native.eval_metrics import compare, first_difference, metrics
from .jobs import cancel_job
from .openenv_runs import OpenEnvRuns
from .runtime import main
from .worker import OpError, Worker, op, state_dir
from kiln.native.scoring import SUITE_NAME, Suite, SuiteError, load_suite, read_suite_file, score



class EvaluatorWorker(Worker):
    kind = "evaluator"
    current: dict | None = None

    def boot(self):
        self.state_dir = state_dir()
        self.store = JobStore(self.state_dir, "eval")
        self.suites = self.state_dir / "eval" / "suites"
        self.adapters = AdapterRegistry(self.state_dir)
        for job in self.store.list():                    # a run this process's predecessor left behind
            if job["state"] == "running":
                job.update(state="failed", finished=time.time(),
                           error=f"the evaluator stopped during the run (killed or crashed) after "
                                 f"{job.get('done', 0)} of {job.get('total', '?')} completions; run it again")
                self.store.save(job)
        self.openenv = OpenEnvRuns(self, self.state_dir)
        self.wake, self.stopping = threading.Event(), threading.Event()
        threading.Thread(target=self._loop, name="kiln-evaluator", daemon=True).start()

    def status(self) -> dict:
        cur = self.current
        return {"job": cur["id"], "done": cur.get("done"), "total": cur.get("total")} if cur else {"job": None}

    def on_stop(self) -> None:
        if hasattr(self, "stopping"):
            self.stopping.set()
            self.wake.set()

    # -- suites -------------------------------------------------------------------------------------

    def _suite(self, body: dict) -> tuple[Suite, dict]:
        """The suite a request names (registered name, file, or inline) and where it came from."""
        try:
            if body.get("suite"):
                name = body["suite"]
                named = isinstance(name, str) and SUITE_NAME.fullmatch(name)    # a name, never a path
                path = self.suites / f"{name}.json"
                if not named or not path.is_file():
                    known = sorted(p.stem for p in self.suites.glob("*.json")) if self.suites.is_dir() else []
                    raise OpError("suite_not_found", f"no registered suite {name!r}"
                                  + (f" (suites: {', '.join(known)})" if known else " (`kiln eval register FILE` adds one)"))
                return read_suite_file(path), {"suite": name}
            if body.get("file"):
                return read_suite_file(body["file"]), {"file": body["file"]}
            if body.get("inline") is not None:
                return load_suite(body["inline"]), {"inline": True}
        except SuiteError as e:
            raise OpError("bad_suite", f"the suite is not valid, nothing was run: {e}") from None
        raise OpError("bad_request", "name a suite: suite (registered name), file, or inline")

    @op("job_cancel", concurrent=True)
    def job_cancel(self, req):
        if str(req.body["id"]).startswith("openenv-"):
            return cancel_job(self.openenv.store, req.body["id"], "OpenEnv", "run")
        return cancel_job(self.store, req.body["id"], "evaluation")

    @op("openenv_submit")
    def openenv_submit(self, req):
        job = self.openenv.submit(req.body)
        self.wake.set()
        return job

    @op("openenv_resume")
    def openenv_resume(self, req):
        job = self.openenv.resume(req.body["id"])
        self.wake.set()
        return job

    @op("eval_register")
    def register(self, req):
        suite, _ = self._suite({"file": req.body["file"]})
        self.suites.mkdir(parents=True, exist_ok=True)
        raw = {"name": suite.name, "description": suite.description, "default_scorer": suite.default_scorer,
               "generation": suite.generation, "system_prompt": suite.system_prompt, "examples": suite.examples}
        write_json_atomic(self.suites / f"{suite.name}.json", raw)
        return {"name": suite.name, "examples": len(suite.examples), "hash": suite.hash}

    # -- jobs ---------------------------------------------------------------------------------------

    @op("eval_submit")
    def submit(self, req):
        b = req.body
        if b.get("replay_of"):
            return self._submit_replay(b["replay_of"])
        suite, source = self._suite(b)
        arms = b.get("adapters") or [b.get("adapter") or ""]
        for a in arms:
            if a:
                try:
                    self.adapters.get(a)
                except (AdapterNotFound, ValueError) as e:
                    raise OpError("adapter_not_found", str(e)) from None
        generation = dict(suite.generation)
        if b.get("seed") is not None:
            generation["seed"] = int(b["seed"])
        spec = {"mode": "compare" if len(arms) > 1 else "run", "source": source, "suite": suite.name,
                "suite_hash": suite.hash, "arms": arms, "generation": generation, "worker": b.get("worker")}
        return self._create(spec, suite)

    def _create(self, spec: dict, suite: Suite) -> dict:
        job = self.store.create(spec, done=0, total=len(suite.examples) * len(spec["arms"]), metrics=None,
                                comparison=None, identities=None, verdict=None)
        raw = {"name": suite.name, "description": suite.description, "default_scorer": suite.default_scorer,
               "generation": suite.generation, "system_prompt": suite.system_prompt, "examples": suite.examples}
        write_json_atomic(self.store.path(job["id"], "suite.json"), raw)
        self.wake.set()
        return job

    def _submit_replay(self, job_id: str) -> dict:
        try:
            orig = self.store.get(job_id)
        except JobNotFound:
            raise OpError("job_not_found", f"no evaluation job {job_id!r}") from None
        if orig["state"] != "completed" or orig["spec"]["mode"] == "replay":
            raise OpError("bad_request", f"job {job_id} is {orig['state']} ({orig['spec']['mode']}); "
                                         f"only a completed run or compare can be replayed")
        suite = load_suite(json.loads(self.store.path(job_id, "suite.json").read_text()))
        spec = dict(orig["spec"], mode="replay", replay_of=job_id)
        return self._create(spec, suite)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            queued = [j for j in (next((j for j in self.store.list() if j["state"] == "queued"), None),
                                  self.openenv.next_queued()) if j]
            if not queued:
                self.wake.wait(1.0)
                self.wake.clear()
                continue
            job = min(queued, key=lambda j: j["created"])         # the older of the two queues' first
            store = self.openenv.store if job["id"].startswith("openenv-") else self.store
            self.current = job
            try:
                if store is self.store:
                    self._run(job)
                else:
                    self.openenv.run(job, self.stopping)
            except Exception as e:  # noqa: BLE001 - the job fails with its reason; the worker goes on
                traceback.print_exc()
                job.update(state="failed", finished=time.time(), error=f"{type(e).__name__}: {e}")
                store.save(job)
            finally:
                self.current = None

    def _run(self, job: dict) -> None:
        jid, spec = job["id"], job["spec"]
        if self.store.cancel_requested(jid):
            job.update(state="cancelled", finished=time.time())
            return self.store.save(job)
        job.update(state="running", started=time.time())
        self.store.save(job)
        suite = load_suite(json.loads(self.store.path(jid, "suite.json").read_text()))
        worker, model_path = self._inference_worker(spec.get("worker"))
        identities = {"suite_sha256": suite.hash, "model": Path(model_path).name,
                      "model_sha256": self._file_hash(Path(model_path)),
                      "adapters": {a: self._adapter_hash(a) for a in spec["arms"] if a},
                      "generation": spec["generation"]}
        job["identities"] = identities
        if spec["mode"] == "replay":
            changed = self._changed_identities(spec["replay_of"], identities)
            if changed:
                job.update(state="completed", finished=time.time(), verdict="error", verdict_detail=changed)
                return self.store.save(job)
        self.store.save(job)
        results: dict[str, list[dict]] = {}
        out = self.store.path(jid, "results.jsonl")
        for arm in spec["arms"]:
            results[arm] = []
            for ex in suite.examples:
                if self.stopping.is_set() or self.store.cancel_requested(jid):
                    stopped = self.store.cancel_requested(jid)
                    job.update(state="cancelled" if stopped else "failed", finished=time.time(),
                               error=None if stopped else "the evaluator was stopped during the run; run it again")
                    return self.store.save(job)
                r = self._one(worker, suite, ex, arm, spec["generation"])
                results[arm].append(r)
                with open(out, "a") as f:
                    f.write(json.dumps(r) + "\n")
                job["done"] += 1
                self.store.save(job)
        job["metrics"] = {arm or "base": metrics(rs, suite.examples) for arm, rs in results.items()}
        arms = spec["arms"]
        if len(arms) > 1:
            job["comparison"] = {f"{arms[0] or 'base'} -> {a or 'base'}": compare(results[arms[0]], results[a])
                                 for a in arms[1:]}
        if spec["mode"] == "replay":
            job["verdict"], job["verdict_detail"] = self._replay_verdict(spec["replay_of"], results)
        job.update(state="completed", finished=time.time())
        self.store.save(job)

    # -- one completion -----------------------------------------------------------------------------

    def _one(self, worker: str, suite: Suite, ex: dict, arm: str, generation: dict) -> dict:
        """One completion through the router (it waits through a restart of the inference worker
        and retries a request that produced nothing, so no retry loop here)."""
        messages = ([{"role": "system", "content": suite.system_prompt}] if suite.system_prompt else []) + ex["messages"]
        body = {"messages": messages, "params": generation, "adapter": arm, "worker": worker}
        t0 = time.perf_counter()
        text, final = [], None
        try:
            for msg in self.request_up("generate", body, timeout=600):
                if msg.type == "chunk":
                    text.append(msg.body["text"])
                else:
                    final = msg.body
                    text.append(final["text"])
        except OpError as e:
            return {"id": ex["id"], "arm": arm, "text": None, "outcome": "error", "score": 0.0,
                    "detail": f"{e.code}: {e.message}", "latency_s": None}
        latency = time.perf_counter() - t0
        answer = "".join(text)
        o = score(answer, ex, ex["scorer"])
        u = final["usage"]
        return {"id": ex["id"], "arm": arm, "text": answer, "outcome": o.outcome, "score": o.score, "detail": o.detail,
                "latency_s": round(latency, 4), "prompt_tokens": u["prompt_tokens"],
                "completion_tokens": u["completion_tokens"], "finish_reason": final["finish_reason"]}

    def _inference_worker(self, name: str | None) -> tuple[str, str]:
        """(worker name, model path) of the inference worker to use — its `info`, asked through
        the router, which waits while the worker loads."""
        body = {"worker": name} if name else {}
        try:
            info = [m for m in self.request_up("info", body, timeout=300)][-1]
        except OpError as e:
            raise OpError(e.code, f"no inference worker to evaluate with: {e.message}") from None
        return info.get("worker"), info.body["path"]

    # -- identities ---------------------------------------------------------------------------------

    def _file_hash(self, path: Path) -> str:
        """sha256 of a file, cached by (path, size, mtime) — a model is hashed once."""
        cache_file = self.state_dir / "eval" / "hashes.json"
        st = path.stat()
        key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if key not in cache:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            cache = {k: v for k, v in cache.items() if not k.startswith(f"{path}|")}
            cache[key] = h.hexdigest()
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(cache_file, cache)
        return cache[key]

    def _adapter_hash(self, name: str) -> str | None:
        try:
            return self._file_hash(Path(self.adapters.get(name)["path"]))
        except AdapterNotFound:
            return None

    def _changed_identities(self, orig_id: str, now: dict) -> list[str]:
        was = self.store.get(orig_id)["identities"]
        changed = []
        if was["model_sha256"] != now["model_sha256"]:
            changed.append(f"model changed: {was['model']} sha256 {was['model_sha256'][:12]}… is now "
                           f"{now['model']} sha256 {now['model_sha256'][:12]}…")
        for a, h in was["adapters"].items():
            if now["adapters"].get(a) != h:
                changed.append(f"adapter {a} changed: sha256 {h[:12]}… is now "
                               f"{(now['adapters'].get(a) or 'deleted')[:12]}")
        if was["suite_sha256"] != now["suite_sha256"]:
            changed.append("suite changed")
        return changed

    def _replay_verdict(self, orig_id: str, results: dict[str, list[dict]]) -> tuple[str, list[dict]]:
        before = {(r["arm"], r["id"]): r["text"] for r in self._results(orig_id)}
        diffs = []
        for arm, rs in results.items():
            for r in rs:
                old = before.get((arm, r["id"]))
                if old is None or r["text"] is None:
                    diffs.append({"arm": arm, "id": r["id"], "first_difference_byte": 0})
                    continue
                at = first_difference(old, r["text"])
                if at is not None:
                    diffs.append({"arm": arm, "id": r["id"], "first_difference_byte": at})
        return ("matched" if not diffs else "mismatch"), diffs

    def _results(self, job_id: str) -> list[dict]:
        try:
            return [json.loads(ln) for ln in self.store.path(job_id, "results.jsonl").read_text().splitlines() if ln]
        except OSError:
            return []


if __name__ == "__main__":
    main(EvaluatorWorker)
