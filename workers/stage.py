"""A later stage of a model split across processes (kind `stage`, issue 41): it holds layers
first..end-1 of the model and their KV caches, and runs the rows of hidden states the first
stage (an inference worker with `split`) sends it — through the supervisor's router, as raw
float32 frames — sending back the rows that stage asks for. No tokenizer, no sampling: the
first stage does those (native/stages.py says how the two stay in step).

Settings: model, stage = [index, count] (this stage's place), ctx, parallel (the first stage's
slots: its caches are kept for that many sequences and a few more), threads, weights, kv types.
"""

from __future__ import annotations

import os
import time

import numpy as np

from kiln.native import kernels
from kiln.native.gguf_file import GGUFError, read_gguf
from kiln.native.kv_types import KVTypeError, settings_kv
from kiln.native.model import WEIGHTS, load_model
from kiln.native.models.library import ModelNotFound, PullError, resolve_model
from kiln.native.scheduler import DEFAULT_PARALLEL
from kiln.native.stages import StageCaches, StageStateLost, stage_layers
from kiln.native.tokenizer import TokenizerError
from kiln.protocol import vocab

from .runtime import main
from .worker import BootError, Chunk, OpError, Worker, op

MAX_ROWS = 8192            # rows of one call: a prompt's chunk is at most a few hundred


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


BOOT_ID = boot_id()


def stage_setting(value) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise BootError(f"stage = {value!r}: [this stage's index, the number of stages]")
    return value[0], value[1]


def stage_of(path, split) -> tuple[int, int]:
    """The layers a stage holds, from the file's header (its layer count)."""
    from kiln.native.config import read_config
    index, count = stage_setting(split)
    try:
        return stage_layers(read_config(read_gguf(path, skip_arrays=True)).n_layer, index, count)
    except ValueError as e:
        raise BootError(f"{path.name}: {e}") from None


class StageWorker(Worker):
    kind = "stage"

    def boot(self):
        self.state = vocab.LOADING
        st = self.settings
        try:
            path = resolve_model(st.get("model") or "default")
            if st.get("threads"):
                kernels.set_threads(int(st["threads"]))
            weights = st.get("weights", "mapped")
            if weights not in WEIGHTS:
                raise BootError(f"weights = {weights!r} is not valid: {' or '.join(WEIGHTS)}")
            self.layers = stage_of(path, st.get("stage"))
            if self.layers[0] == 0:
                raise BootError("a stage worker runs a later stage: the first is the inference worker's")
            self.model = load_model(path, threads=st.get("threads") or None, weights=weights, stage=self.layers)
        except (ModelNotFound, PullError, GGUFError, TokenizerError) as e:
            raise BootError(str(e)) from None
        c = self.model.config
        if self.model.family.recurrent_state(c):
            raise BootError(f"{path.name}: a model with recurrent layers cannot be split (their state cannot be "
                            f"rolled back in step with the first stage)")
        try:
            self.model.use_kv_types(*settings_kv(st))
        except KVTypeError as e:
            raise BootError(f"{path.name}: {e}") from None
        self.n_ctx = int(st.get("ctx") or c.n_ctx_train)
        self.caches = StageCaches(self.model, self.n_ctx, 2 * int(st.get("parallel") or DEFAULT_PARALLEL) + 2)
        self.calls = self.rows = 0
        self.compute_s = 0.0

    def status(self) -> dict:
        m = getattr(self, "model", None)
        if m is None:
            return {"model_spec": self.settings.get("model")}
        return {"model": m.path.stem, "path": str(m.path), "layers": list(self.layers), "n_ctx": self.n_ctx,
                "sequences": len(self.caches.caches), "kv_positions": self.caches.positions,
                "evicted": self.caches.evicted, "calls": self.calls, "rows": self.rows,
                "compute_s": round(self.compute_s, 4)}

    @op("stage_forward")
    def _forward(self, req):
        n = self.model.config.n_embd
        if len(req.buffers) != 1 or len(req.buffers[0]) % (4 * n) or not 0 < len(req.buffers[0]) // (4 * n) <= MAX_ROWS:
            raise OpError("bad_request", f"stage_forward takes one buffer of float32 rows of {n} (at most {MAX_ROWS})")
        x = np.frombuffer(req.buffers[0], np.float32).reshape(-1, n).copy()
        t0, cpu0 = time.perf_counter(), _cpu()
        try:
            out = self.caches.run(x, req.body["seqs"], req.body.get("keep"))
        except StageStateLost as e:
            raise OpError("stage_state_lost", str(e)) from None
        except ValueError as e:
            raise OpError("bad_request", str(e)) from None
        self.compute_s += time.perf_counter() - t0
        self.calls += 1
        self.rows += x.shape[0]
        # the CPU time of this call and which machine spent it: a first stage on the same machine
        # counts it as its own when it decides how many cores others leave it (native/core_share.py)
        return Chunk({"rows": out.shape[0], "cpu_s": _cpu() - cpu0, "boot_id": BOOT_ID}, [out.tobytes()])


if __name__ == "__main__":
    main(StageWorker)
