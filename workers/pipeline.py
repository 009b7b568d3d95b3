"""The first stage of a model split across processes (issue 41): an inference worker whose model
holds layers 0..k-1 (and the embeddings and the output head), and sends each forward's rows on
to the stage workers that hold the rest (workers/stage.py), through the supervisor's router —
raw float32 frames, the same CURVE-protected socket every worker uses. Settings: `stage` =
[0, count] and `stages` = the later stages' worker names, in order (`split = N` on a worker
writes both, supervisor/core/config.py).
"""

from __future__ import annotations

import time

import numpy as np

from .stage import boot_id, stage_of
from .worker import BootError, OpError

STAGE_TIMEOUT = 120.0            # one call: a long prompt's chunk on a busy node
BOOT_ID = boot_id()              # a stage that says the same shares this machine's cores


def stage_kw(path, settings: dict) -> dict:
    """load_model's `stage` for a first stage, or nothing for a whole model."""
    if not settings.get("stage"):
        return {}
    first, end = stage_of(path, settings["stage"])
    if first != 0:
        raise BootError(f"stage = {settings['stage']}: an inference worker is a model's first stage (index 0); "
                        f"later stages are stage workers")
    names = settings.get("stages")
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)
            and len(names) == settings["stage"][1] - 1):
        raise BootError(f"stages = {names!r}: the names of the {settings['stage'][1] - 1} later stage worker(s)")
    return {"stage": (first, end)}


def attach(worker, model) -> "RemoteStages":
    """Make `model` (a first stage) send its rows to the later stages; refuse what a split model
    cannot do yet, by name, instead of ignoring it."""
    st = worker.settings
    for key, why in (("draft_model", "a draft model drafts with a whole model's layers"),):
        if st.get(key):
            raise BootError(f"{key}: a model split across processes runs without it ({why})")
    if st.get("mmproj") not in (None, "off"):
        raise BootError("mmproj: a model split across processes reads no images yet")
    st["mmproj"] = "off"
    if model.family.recurrent_state(model.config):
        raise BootError(f"{model.path.name}: a model with recurrent layers cannot be split (their state cannot be "
                        f"rolled back in step with the later stages)")
    overlap = st.get("pipeline_prefill", "auto")
    if overlap not in ("auto", True, False):
        raise BootError(f"pipeline_prefill = {overlap!r}: auto (when the next stage is on another machine), "
                        f"true or false")
    model.remote = RemoteStages(worker, st["stages"], model.config.n_embd)
    model.remote.overlap = overlap
    return model.remote


class RemoteStages:
    """model.remote of a first stage: the rows through each later stage in turn."""

    def __init__(self, worker, names: list[str], n_embd: int):
        self.worker, self.names, self.n_embd = worker, names, n_embd
        self.overlap = "auto"                     # settings.pipeline_prefill: auto, true or false
        self.shares_cores: bool | None = None     # the later stage runs on this machine (learned from its replies)
        self.calls = 0
        self.bytes_out = self.bytes_in = 0
        self.seconds = 0.0                   # waiting for the later stages: their compute and the hops
        self.cpu_here = 0.0                  # CPU seconds the stages on this machine spent on our calls

    def __call__(self, x: np.ndarray, seqs: list, keep) -> np.ndarray:
        for i in range(len(self.names)):
            x = self._call(i, x, seqs, keep, i == len(self.names) - 1).result()
        return x

    def submit(self, x: np.ndarray, seqs: list, keep) -> "_Pending":
        """The rows sent on now, their answer collected later (`.result()`): a prompt's next
        part is computed here meanwhile (Model.forward). With one later stage (`pipelines`);
        with more, the caller goes step by step."""
        return self._call(0, x, seqs, keep, True)

    def _call(self, i: int, x: np.ndarray, seqs: list, keep, last: bool) -> "_Pending":
        picked = np.arange(x.shape[0])[keep]
        body = {"worker": self.names[i], "seqs": [list(s) for s in seqs]}
        if last and len(picked) != x.shape[0]:
            body["keep"] = picked.tolist()
        out = np.ascontiguousarray(x, np.float32).tobytes()
        self.bytes_out += len(out)
        return _Pending(self, self.names[i], self.worker.send_up("stage_forward", body, STAGE_TIMEOUT, [out]))

    @property
    def pipelines(self) -> bool:
        """May Model.forward send a prompt's parts ahead, computing the next meanwhile? With one
        later stage, on another machine: on this one the two stages' threads would share its
        cores, each step waiting at barriers for the other's (measured: 0.62x of one process for
        a 700-token prompt on 2 cores); `pipeline_prefill = true` asks for it anyway."""
        if len(self.names) != 1 or self.overlap is False:
            return False
        return self.overlap is True or self.shares_cores is False

    def status(self) -> dict:
        return {"stages": self.names, "stage_calls": self.calls, "stage_bytes_out": self.bytes_out,
                "stage_bytes_in": self.bytes_in, "stage_wait_s": round(self.seconds, 4)}


class _Pending:
    def __init__(self, stages: RemoteStages, name: str, call):
        self.stages, self.name, self.call, self.t0 = stages, name, call, time.perf_counter()

    def result(self) -> np.ndarray:
        st = self.stages
        reply = self.call.result()
        if len(reply.buffers) != 1 or len(reply.buffers[0]) % (4 * st.n_embd):
            raise OpError("op_failed", f"stage {self.name} answered without its rows")
        st.seconds += time.perf_counter() - self.t0
        st.calls += 1
        st.bytes_in += len(reply.buffers[0])
        cpu = reply.body.get("cpu_s") if isinstance(reply.body, dict) else None
        if isinstance(reply.body, dict) and isinstance(reply.body.get("boot_id"), str):
            st.shares_cores = reply.body["boot_id"] == BOOT_ID
        if isinstance(cpu, (int, float)) and st.shares_cores:
            st.cpu_here += cpu
        return np.frombuffer(reply.buffers[0], np.float32).reshape(-1, st.n_embd)
