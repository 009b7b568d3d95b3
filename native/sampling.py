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


# editor plugins send a model family's whole list of markers and fences as stop strings (Continue:
# a dozen and more); checking each costs microseconds a token
MAX_STOPS = 64
# the llama.cpp samplers a chain may name (common/sampling.cpp's names)
SAMPLERS = ("penalties", "top_k", "typ_p", "top_p", "min_p", "temperature", "infill")


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
    # llama-server's sampler chain, in its order (None: Kiln's fixed chain, above); a sampler
    # not named does not run — with no "temperature" the draw is at temperature 1
    samplers: list[str] | None = None
    n_indent: int = 0               # stop at a new line indented less than this (code infilling)
    t_max_predict_ms: float = 0.0   # once a line has ended, stop after this long generating (0: off)
    # llama-server's context shift (native/generate.py shift_plan): at the context's end, drop
    # the older half of what follows the first n_keep tokens and go on (off: stop, "length")
    context_shift: bool = False
    n_keep: int = 0                 # -1: the whole prompt
    n_discard: int = 0              # 0: half of what follows n_keep

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
            ("stop", len(self.stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in self.stop),
             f"at most {MAX_STOPS} non-empty strings"),
            ("samplers", self.samplers is None or (isinstance(self.samplers, list) and all(
                x in SAMPLERS for x in self.samplers)), f"a list of {', '.join(SAMPLERS)}"),
            # the infill sampler compares every pair of candidates: top_k first keeps that small
            ("samplers", not self.samplers or "infill" not in self.samplers or (
                "top_k" in self.samplers[:self.samplers.index("infill")] and 0 < self.top_k <= 1000),
             "a chain with 'infill' after 'top_k' (top_k 1 to 1000): infill compares every pair of candidates"),
            ("n_indent", self.n_indent >= 0, "≥ 0"),
            ("t_max_predict_ms", self.t_max_predict_ms >= 0, "≥ 0"),
            ("n_keep", self.n_keep >= -1, "≥ -1 (-1 = the whole prompt)"),
            ("n_discard", self.n_discard >= 0, "≥ 0 (0 = half of what follows n_keep)"),
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
    def __init__(self, params: SamplingParams, stream: int = 0, tok=None):
        """`stream` numbers the sequences of one request (n > 1): each draws from its own
        generator, all fixed by the seed. `tok`: the model's tokenizer, which the infill sampler
        reads (which tokens end generation, each token's text)."""
        self.p, self.tok = params, tok
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
        window = [t for t in window if t >= 0]       # an image's rows (negative ids) are not tokens
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
        if p.samplers is not None:
            return self._chain(self.apply_bias(logits), history)
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

    # -- llama-server's named chain --------------------------------------------------------------

    def _chain(self, logits: np.ndarray, history: list[int]) -> int:
        """The samplers `samplers` names, in its order, on candidates kept sorted by logit (as
        llama.cpp's llama_token_data_array), then a draw from the softmax of what is left."""
        p = self.p
        if p.samplers[:1] == ["top_k"] and 0 < p.top_k < len(logits):
            order = top_ranked(logits, p.top_k)         # the common case, without sorting it all
        else:
            order = np.argsort(-logits, kind="stable")
        cand = logits[order].astype(np.float64)
        for name in p.samplers:
            if name == "penalties":
                pen = self.apply_penalties(logits, history)
                cand = pen[order].astype(np.float64)
                by = np.argsort(-cand, kind="stable")
                order, cand = order[by], cand[by]
            elif name == "top_k" and 0 < p.top_k < len(order):
                order, cand = order[:p.top_k], cand[:p.top_k]
            elif name == "typ_p" and p.typical_p < 1.0:
                order, cand, _ = _typical(order, cand, _softmax(cand), p.typical_p)
            elif name == "top_p" and p.top_p < 1.0:
                keep = int(np.searchsorted(np.cumsum(_softmax(cand)), p.top_p) + 1)
                order, cand = order[:keep], cand[:keep]
            elif name == "min_p" and p.min_p > 0.0:
                probs = _softmax(cand)
                keep = probs >= p.min_p * probs[0]
                order, cand = order[keep], cand[keep]
            elif name == "temperature":
                if p.temperature <= 0.0:
                    order, cand = order[:1], cand[:1]
                else:
                    cand = cand / p.temperature
            elif name == "infill":
                order, cand = infill_filter(order, cand, self.tok)
        if len(order) == 1:
            return int(order[0])
        return int(order[self.rng.choice(len(order), p=_softmax(cand))])


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


def _softmax(cand: np.ndarray) -> np.ndarray:
    e = np.exp(cand - cand.max())
    return e / e.sum()


def infill_filter(order: np.ndarray, cand: np.ndarray, tok) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's infill sampler (llama_sampler_infill_apply), for code completion: when the
    tokens that end generation hold enough of the mass, only they are left; otherwise a token
    whose text begins another's takes that one's probability, and only the tokens clearly ahead
    (p ≥ 0.2, then ≥ 1/(n+1)) are left, the enders always; none left: end of text. It only
    chooses the candidates: the draw that follows uses their logits, as llama.cpp's does."""
    from .tokenizer import TOKEN_CONTROL, TOKEN_UNUSED
    probs = _softmax(cand)
    eog = np.array([int(t) in tok.special.stop_ids for t in order])
    p_eog, p_txt = probs[eog].sum(), probs[~eog].sum()
    if 3 * p_eog * len(order) > p_txt:
        return order[eog], cand[eog]
    # a token's text as llama.cpp renders it here (no special tokens): control and unused
    # tokens have none, so they never merge
    text = [b"" if tok.token_types[int(t)] in (TOKEN_CONTROL, TOKEN_UNUSED) else tok.token_bytes(int(t))
            for t in order]
    probs, gone = probs.copy(), np.zeros(len(order), bool)
    for i0 in range(len(order)):
        for i1 in range(len(order)):
            if gone[i0]:
                break
            if i0 == i1 or gone[i1]:
                continue
            if text[i0] and text[i1].startswith(text[i0]):      # i0's text begins i1's
                dst, src = (i1, i0) if probs[i1] > probs[i0] else (i0, i1)
                probs[dst] += probs[src]
                probs[src], gone[src] = 0.0, True
    keep = (probs >= 0.2) | eog
    n_text = int((keep & ~eog).sum())
    if n_text == 0:
        sp = tok.special
        end = sp.eot if sp.eot is not None else sp.eos
        return np.array([end]), np.array([1.0])
    probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    keep &= (probs >= 1.0 / (n_text + 1)) | eog
    # merged-away tokens left as enders keep llama.cpp's -inf logit: never drawn
    return order[keep], np.where(gone, -np.inf, cand)[keep]
