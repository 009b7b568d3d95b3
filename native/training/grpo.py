"""GRPO's objective for one completion, as per-token weights on the LoRA backward pass.

A group holds completions of one prompt with rewards; a completion's advantage is its reward
minus the group's mean, over the group's standard deviation (+ eps). For completion i with
tokens t, current log-probabilities l_t, the log-probabilities when this update began o_t and
the base model's r_t (the reference, computed once per completion), the loss is

    L = -(1/n) sum_t [ min(q_t A, clip(q_t, 1-e, 1+e) A) - beta * KL_t ],   q_t = exp(l_t - o_t)
    KL_t = exp(r_t - l_t) - (r_t - l_t) - 1          (the k3 estimator, always >= 0)

so dL/dl_t = -(1/n) [ A q_t [not clipped] - beta (1 - exp(r_t - l_t)) ]. The cross-entropy
backward of lora_grad computes the gradient of sum_t w_t (-l_t), so the weights are
w_t = (1/n) [ A q_t [not clipped] - beta (1 - exp(r_t - l_t)) ].
"""

from __future__ import annotations

import numpy as np


def advantages(rewards, eps: float = 1e-4) -> np.ndarray:
    r = np.asarray(rewards, np.float64)
    return (r - r.mean()) / (r.std() + eps)


def objective(adv: float, ref: np.ndarray, old: np.ndarray | None, beta: float = 0.04, clip: float = 0.2,
              stats: dict | None = None):
    """The `weight` function for lora_grad.loss_and_grads: (per-token weights, loss value)."""
    ref = np.asarray(ref, np.float64)

    def weigh(logp: np.ndarray):
        n = len(logp)
        q = np.exp(logp - (logp if old is None else np.asarray(old, np.float64)))
        clipped = np.clip(q, 1 - clip, 1 + clip)
        surrogate = np.minimum(q * adv, clipped * adv)
        d = ref - logp
        kl = np.exp(d) - d - 1
        loss = float(-np.sum(surrogate - beta * kl) / n)
        live = (q * adv) <= (clipped * adv)            # the unclipped term is the min
        w = (adv * q * live - beta * (1 - np.exp(d))) / n
        if stats is not None:
            stats["kl"] = stats.get("kl", 0.0) + float(kl.mean())
            stats["clipped"] = stats.get("clipped", 0) + int((~live).sum())
        return w, loss
    return weigh
