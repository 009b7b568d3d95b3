"""numpy's BLAS keeps one thread while the compiled kernels run (its spinning threads took the
cores from the kernels' OpenMP threads: a Qwen 3.5 prefill ran 1.7x slower), every thread on the
numpy path and for a training pass."""

import numpy as np
import pytest
from conftest import tiny_path

from kiln.native import blas_threads, kernels

pytestmark = pytest.mark.skipif(blas_threads.threads() is None, reason="numpy's BLAS is not an OpenBLAS")


def test_the_engine_keeps_numpy_on_one_blas_thread_and_training_takes_them_all(monkeypatch):
    from kiln.native.lora import LoraConfig, init_adapter
    from kiln.native.model import load_model
    from kiln.native.training import lora_grad
    initial = blas_threads._state["initial"]
    was = kernels.use_compiled(True)
    try:
        compiled = kernels.kernel_info()["path"] == "compiled"
        assert blas_threads.threads() == (1 if compiled else initial)
        m = load_model(tiny_path("llama"))
        base, ad = lora_grad.FrozenBase(m), init_adapter(m, LoraConfig(4, 8.0), np.random.default_rng(0))
        seen, norm = [], lora_grad._norm_fwd
        monkeypatch.setattr(lora_grad, "_norm_fwd", lambda *a: seen.append(blas_threads.threads()) or norm(*a))
        grads = {n: tuple(np.zeros_like(x) for x in ab) for n, ab in ad.tensors.items()}
        lora_grad.loss_and_grads(base, ad.tensors, ad.scale, list(range(5, 17)), range(6, 12), grads)
        assert seen and set(seen) == {initial}                 # the training pass: every thread
        assert blas_threads.threads() == (1 if compiled else initial)     # and back after it
        kernels.use_compiled(False)
        assert blas_threads.threads() == initial               # the numpy path is BLAS: every thread
    finally:
        kernels.use_compiled(was)
