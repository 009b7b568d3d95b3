"""AdamW and the learning-rate schedules the trainer uses, in numpy.

AdamW is torch.optim.AdamW's update, operation for operation (decoupled weight decay applied
to the parameter first, bias corrections folded into the step size and the denominator), so a
step agrees with PyTorch's to rounding.
"""

from __future__ import annotations

import math

import numpy as np


class AdamW:
    def __init__(self, params: list[np.ndarray], lr: float = 2e-4, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        self.params = params
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.t = 0

    def step(self, grads: list[np.ndarray], lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        step_size = lr / bc1
        sqrt_bc2 = math.sqrt(bc2)
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            p *= 1 - lr * self.weight_decay
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * (g * g)
            denom = np.sqrt(v) / sqrt_bc2 + self.eps
            p -= step_size * (m / denom)

    def state(self) -> dict[str, np.ndarray]:
        out = {"adam_t": np.array(self.t)}
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            out[f"adam_m{i}"], out[f"adam_v{i}"] = m, v
        return out

    def load_state(self, st) -> None:
        self.t = int(st["adam_t"])
        for i in range(len(self.params)):
            self.m[i][...] = st[f"adam_m{i}"]
            self.v[i][...] = st[f"adam_v{i}"]


SCHEDULES = ("cosine", "constant")


def learning_rate(step: int, total: int, lr: float, warmup: int, schedule: str) -> float:
    """The rate for optimizer step `step` (0-based) of `total`: linear warmup over `warmup`
    steps, then constant, or cosine decay to zero at the last step."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
