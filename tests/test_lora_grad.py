"""LoRA gradients: central finite differences in float64, and one training step against a
float64 PyTorch re-implementation (its outputs committed as tests/data/lora_torch_*.npz by
tests/tools/torch_lora_reference.py, so this runs without torch)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DATA
from kiln.native.lora import AdapterError, LoraConfig, init_adapter
from kiln.native.training.lora_grad import FrozenBase, loss_and_grads
from kiln.native.model import load_model
from kiln.native.training.optim import AdamW, learning_rate

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]


def _tiny(name):
    return load_model(DATA / "tiny" / f"{name}.gguf")


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.mark.parametrize("name", TINY)
def test_lora_gradients_match_central_differences(name):
    m = _tiny(name)
    base = FrozenBase(m, np.float64)
    rng = np.random.default_rng(7)
    ad = init_adapter(m, LoraConfig(rank=4, alpha=8), rng)
    # B random, not zero: otherwise dA is exactly zero and the check proves nothing for A
    lora = {n: (a.astype(np.float64), rng.normal(0, 0.05, size=b.shape)) for n, (a, b) in ad.tensors.items()}
    tokens = rng.integers(0, 260, size=14)
    targets = [4, 5, 6, 10, 11, 12, 13]
    grads = {n: (np.zeros_like(a), np.zeros_like(b)) for n, (a, b) in lora.items()}
    loss_and_grads(base, lora, 2.0, tokens, targets, grads)

    def f():
        return loss_and_grads(base, lora, 2.0, tokens, targets, {})[0]

    h, worst, checked = 1e-4, 0.0, 0
    for n in lora:                                   # every tensor of every target and layer
        for which in (0, 1):
            M = lora[n][which]
            for idx in [(0, 0), (M.shape[0] // 2, M.shape[1] // 3), (M.shape[0] - 1, M.shape[1] - 1)]:
                old = M[idx]
                vals = []
                for step in (2, 1, -1, -2):
                    M[idx] = old + step * h
                    vals.append(f())
                M[idx] = old
                fd = (-vals[0] + 8 * vals[1] - 8 * vals[2] + vals[3]) / (12 * h)   # 5-point central
                an = grads[n][which][idx]
                worst = max(worst, abs(fd - an) / max(abs(fd), abs(an), 1e-8))
                checked += 1
    assert checked == len(lora) * 6
    assert worst <= 1e-6, f"{name}: worst relative error {worst:.2e}"


@pytest.mark.parametrize("name", TINY)
def test_one_training_step_matches_pytorch(name):
    ref = np.load(DATA / f"lora_torch_{name}.npz")
    rank, alpha, lr, b1, b2, eps, wd = ref["hyper"]
    m = _tiny(name)
    base = FrozenBase(m, np.float64)
    names = sorted({k.split("|")[0] for k in ref.files if "|" in k})
    lora = {n: (ref[n + "|a0"].copy(), ref[n + "|b0"].copy()) for n in names}
    grads = {n: (np.zeros_like(a), np.zeros_like(b)) for n, (a, b) in lora.items()}
    targets = ref["targets"]
    loss, count = loss_and_grads(base, lora, alpha / rank, ref["tokens"], targets, grads, 1.0 / len(targets))
    assert abs(loss / count - float(ref["loss"])) / float(ref["loss"]) <= 1e-6
    for n in names:
        assert _rel(grads[n][0], ref[n + "|ga"]) <= 1e-6, n + ".lora_a"
        assert _rel(grads[n][1], ref[n + "|gb"]) <= 1e-6, n + ".lora_b"
    params = [t for n in names for t in lora[n]]
    opt = AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    opt.step([t for n in names for t in grads[n]])
    for n in names:
        assert _rel(lora[n][0], ref[n + "|a1"]) <= 1e-9 and _rel(lora[n][1], ref[n + "|b1"]) <= 1e-9, n


def test_init_starts_at_the_base_model_and_is_kaiming_uniform():
    m = _tiny("tiny-llama")
    ad = init_adapter(m, LoraConfig(), np.random.default_rng(0))
    assert len(ad.tensors) == 2 * 7 and ad.rank == 16 and ad.scale == 2.0
    a, b = ad.tensors["blk.0.ffn_down.weight"]
    assert a.shape == (16, 256) and b.shape == (128, 16)
    assert not b.any() and np.abs(a).max() <= 1 / np.sqrt(256) and np.abs(a).max() > 0.9 / np.sqrt(256)


def test_moe_and_bad_configs_are_refused():
    with pytest.raises(AdapterError, match="dense"):
        FrozenBase(_tiny("tiny-qwen3moe"))
    with pytest.raises(AdapterError, match="targets"):
        LoraConfig(targets=("attn_q", "lm_head"))
    with pytest.raises(AdapterError, match="rank"):
        LoraConfig(rank=0)


def test_schedules():
    assert learning_rate(0, 100, 1e-3, 10, "cosine") == pytest.approx(1e-4)
    assert learning_rate(9, 100, 1e-3, 10, "cosine") == pytest.approx(1e-3)
    assert learning_rate(10, 100, 1e-3, 10, "cosine") == pytest.approx(1e-3)
    assert learning_rate(99, 100, 1e-3, 10, "cosine") < 1e-6 + 1e-3 * 0.001
    assert learning_rate(55, 100, 1e-3, 0, "constant") == 1e-3
