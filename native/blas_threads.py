"""How many threads numpy's BLAS (OpenBLAS) runs, set while the process runs.

OpenBLAS's threads keep spinning for a while after each call, waiting for more work (2^28 cycles,
~0.1 s, by default). In the engine, numpy products sit between the compiled kernels — Qwen 3.5's
delta nets solve their prompt chunks with numpy — and while those threads spin, the kernels'
OpenMP threads find no free core: a Qwen3.5-0.8B Q4_K_M prefill of 512 tokens took 6.35 s with
numpy's 2 BLAS threads and 3.78 s with one (same machine, same run). So a process that runs the
compiled kernels keeps numpy single-threaded (`for_engine`, called by kernels.py), and the training passes, which are
numpy and BLAS-bound (a LoRA step on the 135M model 1.3x faster with two threads), take every
thread numpy started with for their duration (`all_threads`).

Another BLAS (MKL, Accelerate) or a numpy without OpenBLAS: nothing is changed.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager

_SYMBOLS = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
            ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
            ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
            ("openblas_set_num_threads", "openblas_get_num_threads"))
_lock = threading.Lock()
_state: dict = {}


def _openblas():
    """(set, get) of the OpenBLAS numpy loaded, or None; looked up once."""
    if "fns" not in _state:
        import numpy  # noqa: F401 — loads its BLAS
        _state["fns"] = None
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
        except OSError:
            paths = []
        for path in paths:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for set_name, get_name in _SYMBOLS:
                if hasattr(lib, set_name) and hasattr(lib, get_name):
                    setter, getter = getattr(lib, set_name), getattr(lib, get_name)
                    setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                    _state["fns"] = (setter, getter)
                    _state["initial"] = max(1, getter())
                    break
            if _state["fns"]:
                break
    return _state["fns"]


def threads() -> int | None:
    """numpy's BLAS threads now (None: not an OpenBLAS this module can set)."""
    fns = _openblas()
    return fns[1]() if fns else None


def for_engine(compiled: bool) -> None:
    """One BLAS thread while the compiled kernels run, so that their OpenMP threads get the cores
    (see the module's doc); the threads numpy started with on the numpy path, which is BLAS."""
    fns = _openblas()
    if fns:
        with _lock:
            fns[0](1 if compiled else _state["initial"])


@contextmanager
def all_threads():
    """numpy's BLAS with the threads it started with, for a numpy-bound pass (training); one again
    after it if it was one before."""
    fns = _openblas()
    if not fns:
        yield
        return
    with _lock:
        before = fns[1]()
        fns[0](_state["initial"])
    try:
        yield
    finally:
        with _lock:
            fns[0](before)
