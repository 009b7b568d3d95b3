"""The trainer worker (kind `trainer`): LoRA SFT jobs from the queue on disk, one at a time.

`train_submit` validates the data file against the model's chat template (every bad line is
reported; nothing is queued unless the whole file is good), copies it into the job folder and
queues the job. A background thread runs jobs FIFO — an interrupted one (the trainer was
killed, or stopped by `kiln down`) first, from its checkpoint. Status and loss history are
read from the job store on disk by the supervisor; a cancel comes as the `job_cancel` op.

The process is its own: a training crash or OOM never touches inference. `threads` (the
worker's setting) bounds BLAS threads, set before numpy loads.
"""

from __future__ import annotations

import json
import os


def _limit_threads() -> None:
    try:
        n = int(json.loads(os.environ.get("KILN_WORKER_SETTINGS") or "{}").get("threads") or 0)
    except (ValueError, AttributeError):
        n = 0
    if n > 0:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(n)


_limit_threads()

import hashlib  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from kiln.protocol.store.adapter_registry import AdapterNotFound, AdapterRegistry, check_name  # noqa: E402
from kiln.native.chat_template import TemplateError, template_for  # noqa: E402
from kiln.native.gguf_file import GGUFError  # noqa: E402
from kiln.native.models.library import ModelNotFound, PullError, resolve_model  # noqa: E402
from kiln.native.lora import TRAINABLE_ARCHS, file_sha256  # noqa: E402
from kiln.native.model import load_model  # noqa: E402
from kiln.native.data_file import DataFileError, read_data_file  # noqa: E402
from kiln.native.training.sft_data import DataError, load_grpo_file, load_opd_file, load_sft_file  # noqa: E402
from kiln.native.training.opd import LocalTeacher, TeacherError, URLTeacher, heldout_kl, is_url  # noqa: E402
from kiln.native.training.opd_run import OPDRun, OPDSpec  # noqa: E402
from kiln.native.training.sft_trainer import GRPORun, SFTRun, TrainSpec  # noqa: E402

SPECS = {"sft": TrainSpec, "grpo": TrainSpec, "opd": OPDSpec}
RUNS = {"sft": SFTRun, "grpo": GRPORun, "opd": OPDRun}
GRPO_ONLY = ("beta", "clip")


def load_examples(method: str, path, template, tokenizer, spec, raw: bytes | None = None) -> list:
    if method == "opd":
        return load_opd_file(path, template, tokenizer, spec.max_seq_len, raw, spec.max_new_tokens)
    return {"sft": load_sft_file, "grpo": load_grpo_file}[method](path, template, tokenizer, spec.max_seq_len, raw)
from kiln.protocol.store.job_store import FINAL, JobStore  # noqa: E402

from .jobs import cancel_job  # noqa: E402
from .runtime import main  # noqa: E402
from .worker import OpError, Worker, op, state_dir  # noqa: E402


class TrainerWorker(Worker):
    kind = "trainer"
    stop_grace = 30.0          # finish the example in flight and write the checkpoint
    current: dict | None = None

    def boot(self):
        self.store = JobStore(state_dir())
        self.registry = AdapterRegistry(state_dir())
        self._model = None                      # (path, Model, template), loaded on first use
        self._model_lock = threading.Lock()
        self.wake, self.stopping, self.idle = threading.Event(), threading.Event(), threading.Event()
        self.idle.set()
        self.current: dict | None = None
        self.thread = threading.Thread(target=self._loop, name="kiln-trainer", daemon=True)
        self.thread.start()

    def status(self) -> dict:
        cur = self.current
        queued = sum(1 for j in self.store.list() if j["state"] == "queued") if hasattr(self, "store") else 0
        if not cur:
            return {"job": None, "queued": queued}
        return {"job": cur["id"], "step": cur["step"], "total_steps": cur["total_steps"],
                "loss": cur["loss"], "queued": queued}

    def on_stop(self) -> None:
        if hasattr(self, "stopping"):
            self.stopping.set()
            self.wake.set()

    def stop_pending(self) -> bool:
        return hasattr(self, "idle") and not self.idle.is_set()

    # -- the model ----------------------------------------------------------------------------------

    def model(self, spec: str):
        """(path, Model, chat template) for a model spec; one model is kept loaded."""
        with self._model_lock:
            try:
                path = resolve_model(spec or "default", pull=(spec in (None, "", "default")))
            except (ModelNotFound, PullError) as e:
                raise OpError("model_not_found", str(e)) from None
            if self._model is None or self._model[0] != path:
                self._model = None
                try:
                    m = load_model(path)
                except GGUFError as e:
                    raise OpError("bad_model", str(e)) from None
                try:
                    template = template_for(m)
                except TemplateError:
                    template = None
                self._model = (path, m, template)
            return self._model

    # -- ops ----------------------------------------------------------------------------------------

    @op("job_cancel", concurrent=True)
    def job_cancel(self, req):
        return cancel_job(self.store, req.body["id"], "training")

    @op("train_submit")
    def submit(self, req):
        b = req.body
        name = b["adapter"]
        method = b.get("method", "sft")
        try:
            check_name(name)
            if method not in SPECS:
                raise ValueError(f"method {method!r} is not one of {', '.join(SPECS)}")
            given = set(b.get("options") or {})
            if method != "grpo" and set(GRPO_ONLY) & given:
                raise ValueError(f"{' and '.join(sorted(set(GRPO_ONLY) & given))}: GRPO options; {method} has no use for them")
            if method != "opd" and set(OPDSpec.METHOD_ONLY) & given:
                raise ValueError(f"{', '.join(sorted(set(OPDSpec.METHOD_ONLY) & given))}: OPD options; "
                                 f"{method} samples nothing")
            if method != "opd" and b.get("eval_file"):
                raise ValueError(f"eval_file holds OPD's held-out prompts; {method} has no use for it")
            if (method == "opd") != bool(b.get("teacher")):
                raise ValueError("opd needs a teacher (a model of the library or an http(s) URL)" if method == "opd"
                                 else f"teacher is an OPD field; {method} has no teacher")
            spec = SPECS[method].from_dict(dict(b.get("options") or {}))
        except (ValueError, TypeError) as e:
            raise OpError("bad_request", str(e)) from None
        try:
            self.registry.get(name)
            raise OpError("adapter_exists", f"an adapter named {name!r} exists; delete it "
                                            f"(`kiln adapters delete {name}`) or choose another name")
        except AdapterNotFound:
            pass
        busy = [j["id"] for j in self.store.list() if j["adapter"] == name and j["state"] not in FINAL]
        if busy:
            raise OpError("adapter_exists", f"job {busy[0]} is already training adapter {name!r}")
        path, m, template = self.model(b.get("model") or self.settings.get("model") or "default")
        if m.config.arch not in TRAINABLE_ARCHS or m.config.is_moe:
            raise OpError("unsupported_model", f"LoRA training supports dense {', '.join(TRAINABLE_ARCHS)} "
                                               f"models; {path.name} is {m.config.arch}"
                                               f"{' (MoE)' if m.config.is_moe else ''}")
        file = Path(b["file"])
        try:       # read once: what is checked, hashed and kept is the same bytes
            raw = read_data_file(file)
            examples = load_examples(method, file, template, m.tokenizer, spec, raw)
            held_raw = read_data_file(Path(b["eval_file"])) if b.get("eval_file") else None
            if held_raw is not None:
                load_examples(method, Path(b["eval_file"]), template, m.tokenizer, spec, held_raw)
        except (DataFileError, DataError) as e:
            raise OpError("bad_data", str(e)) from None
        extra = {}
        if method == "opd":        # preflight: the teacher loads and reads the student's ids as its own
            extra = {"teacher": self._teacher_spec(b["teacher"]), "teacher_model": b.get("teacher_model")}
            self._check_teacher(extra, m, examples[0].tokens)
        flat = [c for g in examples for c in g.completions] if method == "grpo" else examples
        targets = len(examples) * spec.samples * spec.max_new_tokens if method == "opd" \
            else sum(len(e.targets) for e in flat)           # OPD: the most it will sample per epoch
        job = self.store.create({"adapter": name, "model": str(path), "file": str(file), "method": method,
                                 "data_sha256": hashlib.sha256(raw).hexdigest(), "options": spec.as_dict(),
                                 "examples": len(examples), "tokens": sum(len(e.tokens) for e in flat),
                                 "target_tokens": targets, "held_out": held_raw is not None, **extra},
                                adapter=name, step=0, total_steps=None, epoch=0, loss=None, tokens_per_s=None,
                                eta_s=None)
        self.store.path(job["id"], "data.jsonl").write_bytes(raw)
        if held_raw is not None:
            self.store.path(job["id"], "held_out.jsonl").write_bytes(held_raw)
        self.wake.set()
        return job

    # -- OPD's teacher --------------------------------------------------------------------------------

    def _teacher_spec(self, spec) -> str:
        if not isinstance(spec, str):
            raise OpError("bad_request", "teacher must be a model of the library or an http(s) URL")
        if is_url(spec):
            return spec
        try:
            return str(resolve_model(spec))
        except (ModelNotFound, PullError) as e:
            raise OpError("model_not_found", f"teacher: {e}") from None

    def teacher(self, job_spec: dict, student):
        """The job's teacher, checked against the student; a local one is kept loaded."""
        spec = job_spec["teacher"]
        try:
            if is_url(spec):
                return URLTeacher(spec, job_spec.get("teacher_model"))
            if getattr(self, "_teacher", None) is None or self._teacher[0] != spec:
                self._teacher = None
                try:
                    self._teacher = (spec, load_model(Path(spec)))
                except (GGUFError, OSError) as e:
                    raise OpError("bad_model", f"teacher {spec}: {e}") from None
            return LocalTeacher(self._teacher[1], student)
        except TeacherError as e:
            raise OpError("bad_teacher", str(e)) from None

    def _check_teacher(self, job_spec: dict, student, tokens: list[int]) -> None:
        t = self.teacher(job_spec, student)
        if isinstance(t, URLTeacher):
            try:
                t.check_vocabulary(tokens, student.tokenizer)
            except TeacherError as e:
                raise OpError("bad_teacher", str(e)) from None

    # -- the job thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping.is_set():
            job = self.store.next_job()
            if job is None:
                self.wake.wait(1.0)
                self.wake.clear()
                continue
            self.idle.clear()
            try:
                if self.stopping.is_set():
                    return
                self._run(job)
            finally:
                self.current = None
                self.idle.set()

    def _run(self, job: dict) -> None:
        jid = job["id"]
        if self.store.cancel_requested(jid):
            job.update(state="cancelled", finished=time.time())
            return self.store.save(job)
        job.update(state="running", started=job.get("started") or time.time(), error=None)
        self.store.save(job)
        self.current = job
        spec = job["spec"]
        try:
            path, m, template = self.model(spec["model"])
            method = spec.get("method", "sft")
            opts = SPECS[method].from_dict(spec["options"])
            examples = load_examples(method, self.store.path(jid, "data.jsonl"), template, m.tokenizer, opts)
            held = load_examples(method, self.store.path(jid, "held_out.jsonl"), template, m.tokenizer, opts) \
                if spec.get("held_out") else None
            teacher = self.teacher(spec, m) if method == "opd" else None
            run = RUNS[method](m, examples, opts, self.store.path(jid, ""), **({"teacher": teacher} if teacher else {}))
            job["total_steps"] = run.total_steps
            if held and teacher and "held_out_kl_before" not in job:
                job["held_out_kl_before"] = heldout_kl(m, teacher, held, opts)
            self.store.save(job)

            def on_step(p):
                job.update(step=p.step, epoch=p.epoch, loss=p.loss, tokens_per_s=round(p.tokens_per_s, 2),
                           eta_s=round(p.eta_s, 1), **p.extra)
                self.store.save(job)

            result = run.run(lambda: self.stopping.is_set() or self.store.cancel_requested(jid), on_step)
            if result == "completed":
                name = spec["adapter"]
                run.meta = {"kiln.base_model": path.name, "kiln.job": jid}
                run.save(self.registry.gguf_path(name), name)
                self.registry.register(name, {
                    "base_model": path.name, "base_path": str(path), "base_sha256": file_sha256(path),
                    "job": jid, "method": method, **({"teacher": spec["teacher"]} if teacher else {}),
                    "data_sha256": spec["data_sha256"], "rank": opts.rank, "alpha": opts.alpha,
                    "targets": list(opts.targets), "steps": run.total_steps, "final_loss": job["loss"]})
                self.store.path(jid, "checkpoint.npz").unlink(missing_ok=True)
                if held and teacher:
                    job["held_out_kl_after"] = heldout_kl(m, teacher, held, opts, run._student())
                job.update(state="completed", finished=time.time(), eta_s=0)
            elif self.store.cancel_requested(jid):
                job.update(state="cancelled", finished=time.time())
            else:                    # stopped gracefully: checkpointed; the next trainer resumes it
                job.update(state="paused", pauses=job.get("pauses", 0) + 1, paused_at_step=job["step"])
        except OpError as e:
            job.update(state="failed", finished=time.time(), error=e.message)
        except TeacherError as e:            # the teacher went away or answered nonsense mid-run
            job.update(state="failed", finished=time.time(), error=str(e))
        except Exception as e:  # noqa: BLE001 - the job fails with its reason; the worker goes on
            traceback.print_exc()
            job.update(state="failed", finished=time.time(), error=f"{type(e).__name__}: {e}")
        self.store.save(job)


if __name__ == "__main__":
    main(TrainerWorker)
