"""GRPO's objective as weights on the LoRA backward pass (fast tier): its gradient matches
central finite differences in float64 on a tiny model — with the policy ratio inside and
outside the clip range and the KL term on — and the group advantages are centred and scaled."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DATA
from kiln.native.lora import LoraConfig, init_adapter
from kiln.native.model import load_model
from kiln.native.training.grpo import advantages, objective
from kiln.native.training.lora_grad import FrozenBase, loss_and_grads


def _logp(base, lora, tokens, targets):
    got = {}

    def keep(lp):
        got["lp"] = lp
        return np.zeros_like(lp), 0.0
    loss_and_grads(base, lora, 2.0, tokens, targets, {}, keep)
    return got["lp"]


@pytest.mark.parametrize("adv", [1.3, -0.8])
def test_grpo_gradient_matches_central_differences(adv):
    m = load_model(DATA / "tiny" / "tiny-llama.gguf")
    base = FrozenBase(m, np.float64)
    rng = np.random.default_rng(11)
    ad = init_adapter(m, LoraConfig(rank=4, alpha=8), rng)
    lora = {n: (a.astype(np.float64), rng.normal(0, 0.05, size=b.shape)) for n, (a, b) in ad.tensors.items()}
    tokens = rng.integers(0, 260, size=14)
    targets = list(range(6, 14))                           # the completion's tokens
    ref = _logp(base, {}, tokens, targets)                 # the base model: KL's reference
    # the log-probabilities this update began from: near the current ones, some outside the clip
    old = _logp(base, lora, tokens, targets) + rng.normal(0, 0.3, size=len(targets))
    stats = {}
    weigh = objective(adv, ref, old, beta=0.1, clip=0.2, stats=stats)
    grads = {n: (np.zeros_like(a), np.zeros_like(b)) for n, (a, b) in lora.items()}
    loss_and_grads(base, lora, 2.0, tokens, targets, grads, weigh)
    assert 0 < stats["clipped"] < len(targets), "the check must cover clipped and unclipped tokens"

    def f():
        return loss_and_grads(base, lora, 2.0, tokens, targets, {}, objective(adv, ref, old, 0.1, 0.2))[0]
    h = 1e-6
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        for which in (0, 1):
            t = lora[name][which]
            for idx in [tuple(rng.integers(0, s) for s in t.shape) for _ in range(3)]:
                keep = t[idx]
                t[idx] = keep + h
                up = f()
                t[idx] = keep - h
                down = f()
                t[idx] = keep
                fd = (up - down) / (2 * h)
                an = grads[name][which][idx]
                assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)) + 1e-9, (name, which, idx, fd, an)


def test_advantages_are_centred_and_scaled():
    a = advantages([1.0, 0.0, 0.0, 1.0])
    assert np.allclose(a, [1, -1, -1, 1], atol=1e-3) and abs(a.sum()) < 1e-12
    assert np.all(advantages([2.0, 2.0, 2.0]) == 0)            # no signal in a uniform group
