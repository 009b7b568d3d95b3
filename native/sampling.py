"""Choosing the next token from logits.

The chain runs in llama.cpp's order: logit bias → penalties → top-k → typical → top-p → min-p →
temperature → draw.
Temperature ≤ 0 is greedy. A seeded `numpy.random.Generator` makes a run repeatable: the same
seed and the same input give the same tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

import numpy as np


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it."""


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40                 # 0 = off
    top_p: float = 0.95             # 1.0 = off
    min_p: float = 0.05             # 0.0 = off
    repeat_penalty: float = 1.0     # 1.0 = off
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None     # None = off; n = also return the top-n alternatives
    typical_p: float = 1.0          # 1.0 = off (locally typical sampling)
    logit_bias: dict = field(default_factory=dict)      # token id -> added to its logit
    grammar: str | None = None      # llguidance grammar the output must match (native/constrain.py)
    speculative: bool = True        # may check prompt-lookup drafts (never changes the text)

    def validate(self) -> "SamplingParams":
        checks = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "between 0 and 100"),
            ("top_k", self.top_k >= 0, "≥ 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repeat_penalty", self.repeat_penalty > 0.0, "> 0"),
            ("repeat_last_n", self.repeat_last_n >= -1, "≥ -1 (-1 = whole context)"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "between -2 and 2"),
            ("max_tokens", self.max_tokens >= 0, "≥ 0"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "between 0 and 20"),
            ("typical_p", 0.0 < self.typical_p <= 1.0, "in (0, 1]"),
            ("logit_bias", all(isinstance(k, int) and -100 <= v <= 100 for k, v in self.logit_bias.items()),
             "token ids mapped to values between -100 and 100"),
            ("stop", len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
             "at most 16 non-empty strings"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise SamplingError(f"{name} = {getattr(self, name)!r} is out of range: must be {allowed}")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SamplingError(f"unknown sampling parameter(s) {sorted(unknown)}; "
                                f"known: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("logit_bias"), list):           # [[id, bias], …]: the wire form
            d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"]}
        return cls(**d).validate()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def top_ranked(logits: np.ndarray, k: int) -> np.ndarray:
    """np.argsort(-logits, kind="stable")[:k], without sorting the whole vocabulary: a partition
    finds the k-th largest logit, and only the logits at or above it (every tie included, so
    ties still fall to the lower id) are sorted. 0.3 ms instead of 6 ms over 49k logits."""
    kth = np.partition(logits, len(logits) - k)[len(logits) - k]
    idx = np.flatnonzero(logits >= kth)
    return idx[np.argsort(-logits[idx], kind="stable")][:k]


class Sampler:
    def __init__(self, params: SamplingParams, stream: int = 0):
        """`stream` numbers the sequences of one request (n > 1): each draws from its own
        generator, all fixed by the seed."""
        self.p = params
        self.rng = np.random.default_rng(params.seed if stream == 0 or params.seed is None
                                         else [params.seed, stream])

    def apply_bias(self, logits: np.ndarray) -> np.ndarray:
        if not self.p.logit_bias:
            return logits
        logits = logits.copy()
        for t, b in self.p.logit_bias.items():
            if 0 <= t < len(logits):
                logits[t] = -np.inf if b <= -100 else logits[t] + b
        return logits

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        p = self.p
        if not history or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                           and p.frequency_penalty == 0.0):
            return logits
        window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n:] if p.repeat_last_n else []
        if not window:
            return logits
        logits = logits.copy()
        counts = Counter(window)
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        n = np.fromiter(counts.values(), dtype=np.float32)
        sel = logits[ids]
        if p.repeat_penalty != 1.0:
            sel = np.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        sel = sel - n * p.frequency_penalty - p.presence_penalty
        logits[ids] = sel
        return logits

    def sample(self, logits: np.ndarray, history: list[int]) -> int:
        p = self.p
        logits = self.apply_penalties(self.apply_bias(logits), history)
        if p.temperature <= 0.0:
            return int(np.argmax(logits))
        if 0 < p.top_k < len(logits):
            order = top_ranked(logits, p.top_k)
        else:
            order = np.argsort(-logits, kind="stable")
        cand = logits[order].astype(np.float64)
        probs = np.exp(cand - cand[0])
        probs /= probs.sum()
        if p.typical_p < 1.0:
            order, cand, probs = _typical(order, cand, probs, p.typical_p)
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, cand, probs = order[:keep], cand[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            order, cand = order[keep], cand[keep]
        scaled = (cand - cand[0]) / p.temperature
        probs = np.exp(scaled)
        probs /= probs.sum()
        return int(order[self.rng.choice(len(order), p=probs)])


def _typical(order, cand, probs, mass: float):
    """Locally typical sampling (Meier et al. 2022, as llama.cpp): keep the tokens whose
    surprise is closest to the distribution's entropy until they hold `mass`."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(probs)
        entropy = -np.nansum(probs * logp)
        shift = np.abs(-logp - entropy)
    by = np.argsort(shift, kind="stable")
    keep = int(np.searchsorted(np.cumsum(probs[by]), mass) + 1)
    sel = np.sort(by[:max(1, keep)])          # back in descending-probability order
    probs = probs[sel] / probs[sel].sum()
    return order[sel], cand[sel], probs
