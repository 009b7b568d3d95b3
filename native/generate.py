"""Text generation over one sequence: prefix reuse, prefill, decode, stop handling.

`Sequence.generate` yields `Token` events as tokens are chosen and ends with one `Finish`.
Text is released only when it cannot be the start of a stop string, so a stop string split
across tokens never leaks into the output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .kv_cache import KVCache
from .model import Model
from .sampling import Sampler, SamplingParams, log_softmax


@dataclass
class Token:
    id: int
    text: str                                   # text released with this token (may be "")
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Finish:
    reason: str                                 # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int                          # prompt tokens reused from the KV cache
    text: str = ""                              # text released at the end (held-back tail)
    prefill_s: float = 0.0
    decode_s: float = 0.0


class ContextLengthError(ValueError):
    def __init__(self, n_prompt: int, max_tokens: int, n_ctx: int):
        super().__init__(f"this request needs {n_prompt} prompt tokens + {max_tokens} to generate "
                         f"= {n_prompt + max_tokens} tokens, but the context holds {n_ctx}; "
                         f"shorten the prompt or lower max_tokens")
        self.n_prompt, self.max_tokens, self.n_ctx = n_prompt, max_tokens, n_ctx


def _stop_hold(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could begin a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class Sequence:
    """One conversation's KV cache on a model; reuses the cached prefix across calls."""

    def __init__(self, model: Model, n_ctx: int | None = None):
        self.model = model
        self.n_ctx = n_ctx or model.config.n_ctx_train
        self.cache: KVCache = model.new_cache(self.n_ctx)

    def prefill(self, prompt: list[int]) -> tuple[np.ndarray, int]:
        """Bring the cache to `prompt`, reusing its longest cached prefix; return the last
        position's logits and how many prompt tokens were reused."""
        reuse = min(self.cache.common_prefix(prompt), len(prompt) - 1)
        self.cache.truncate(reuse)
        return self.model.forward(prompt[reuse:], self.cache), reuse

    def generate(self, prompt: list[int], params: SamplingParams,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[Token | Finish]:
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt) + params.max_tokens > self.n_ctx:
            raise ContextLengthError(len(prompt), params.max_tokens, self.n_ctx)
        tok = self.model.tokenizer
        sampler = Sampler(params)
        decoder = tok.stream_decoder(skip_control=True)
        stops = list(params.stop)
        t0 = time.perf_counter()
        logits, cached = self.prefill(prompt)
        t1 = time.perf_counter()
        history = list(prompt)
        pending = ""          # decoded text not yet released (may start a stop string)
        n_out = 0
        reason = "length"
        while n_out < params.max_tokens:
            if cancelled():
                reason = "cancelled"
                break
            tid = sampler.sample(logits, history)
            lp, top = None, []
            if params.logprobs is not None:
                ls = log_softmax(logits)
                lp = float(ls[tid])
                if params.logprobs:
                    best = np.argsort(-ls)[:params.logprobs]
                    top = [(int(i), float(ls[i])) for i in best]
            n_out += 1
            history.append(tid)
            if tid in tok.special.stop_ids and not params.ignore_eos:
                reason = "stop"
                yield Token(tid, "", lp, top)
                break
            pending += decoder.feed(tid)
            hit = min(((pending.find(s), s) for s in stops if s in pending), default=None)
            if hit is not None:
                yield Token(tid, pending[:hit[0]], lp, top)
                pending = ""
                reason = "stop"
                break
            release = len(pending) - _stop_hold(pending, stops)
            yield Token(tid, pending[:release], lp, top)
            pending = pending[release:]
            if n_out >= params.max_tokens:
                break
            logits = self.model.forward([tid], self.cache)
        if reason != "stop":
            pending += decoder.flush()
        else:
            pending = ""
        t2 = time.perf_counter()
        yield Finish(reason, len(prompt), n_out, cached, pending, t1 - t0, t2 - t1)


def generate_text(model: Model, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, Finish]:
    """Run a whole generation; return (token ids, text, finish)."""
    ids, parts = [], []
    for ev in Sequence(model).generate(prompt, params):
        if isinstance(ev, Token):
            ids.append(ev.id)
            parts.append(ev.text)
        else:
            parts.append(ev.text)
            return ids, "".join(parts), ev
    raise AssertionError("generate() ended without a Finish")
