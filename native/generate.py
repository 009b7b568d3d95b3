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

from .constrain import Constraint
from .kv_cache import KVCache
from .model import Model
from .sampling import Sampler, SamplingParams, log_softmax


@dataclass
class Token:
    id: int
    text: str                                   # text released with this token (may be "")
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    index: int = 0                              # which sequence of the request (n > 1)


@dataclass
class Finish:
    reason: str                                 # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int                          # prompt tokens reused from the KV cache
    text: str = ""                              # text released at the end (held-back tail)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    index: int = 0
    drafted: int = 0                            # speculative draft tokens checked
    accepted: int = 0                           # … and kept
    stop_string: str | None = None              # the stop string that ended it, if one did
    context_shifts: int = 0                     # how often the context shifted (shift_plan)


class ContextLengthError(ValueError):
    def __init__(self, n_prompt: int, max_tokens: int, n_ctx: int, why: str = ""):
        super().__init__(f"this request needs {n_prompt} prompt tokens + {max_tokens} to generate "
                         f"= {n_prompt + max_tokens} tokens, but the context holds {n_ctx}; "
                         f"shorten the prompt or lower max_tokens{why}")
        self.n_prompt, self.max_tokens, self.n_ctx = n_prompt, max_tokens, n_ctx


def check_context(prompt: list[int], params: SamplingParams, n_ctx: int, can_shift: bool) -> None:
    """Refuse a request that cannot be answered in `n_ctx` positions: its prompt and max_tokens
    must fit — or, with context_shift, the prompt must leave room to generate and the cache must
    be one that can shift."""
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed")
    if len(prompt) + params.max_tokens <= n_ctx:
        return
    if not params.context_shift:
        raise ContextLengthError(len(prompt), params.max_tokens, n_ctx)
    if not can_shift:
        raise ContextLengthError(len(prompt), params.max_tokens, n_ctx, "; the context cannot shift on this "
                                 "model (its sliding-window or recurrent layers keep no earlier keys, or "
                                 "M-RoPE places its rows)")
    if len(prompt) >= n_ctx - 4:
        raise ContextLengthError(len(prompt), params.max_tokens, n_ctx, "; a context shift makes room for "
                                 "what is generated, not for the prompt, which must fit with a few tokens to spare")


def shift_plan(n_held: int, n_prompt: int, n_ctx: int, params: SamplingParams, add_bos: bool) -> tuple[int, int]:
    """llama-server's context shift, decided as it decides it (pre_decode): when the cache holds
    n_ctx - 1 positions, keep the first n_keep (-1: the whole prompt; one more with a BOS; at most
    n_ctx - 4) and drop n_discard of the rest (0: half), clamped to leave one. (n_keep, n_discard);
    n_discard 0: nothing can go."""
    n_keep = n_prompt if params.n_keep < 0 else params.n_keep
    n_keep = min(n_ctx - 4, n_keep + (1 if add_bos else 0))
    n_left = n_held - n_keep
    n_discard = params.n_discard or n_left // 2
    return n_keep, max(0, min(n_discard, n_left - 1))


def _stop_hold(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could begin a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


PREFILL_CHUNK = 256


class Generation:
    """One request's decoding state: sampler, stop strings, streamed text. Whoever runs the
    model (a Sequence alone, or a batch of them) feeds it each step's logits."""

    def __init__(self, model: Model, prompt: list[int], params: SamplingParams, cached: int = 0,
                 index: int = 0, show: frozenset[int] = frozenset()):
        self.tok = model.tokenizer
        self.params = params
        self.index = index
        self.sampler = Sampler(params, stream=index, tok=self.tok)
        # a grammar the output must match: its mask is applied before sampling
        self.constraint = Constraint(params.grammar, self.tok) if params.grammar else None
        self.decoder = self.tok.stream_decoder(skip_control=True, keep=show)
        self.history = list(prompt)
        self.n_prompt, self.cached = len(prompt), cached
        self.pending = ""          # decoded text not yet released (may start a stop string)
        self.n_out = 0
        self.reason: str | None = None
        self.stop_string: str | None = None
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.drafted = self.accepted = 0        # speculative decoding (native/speculate.py)
        self.shifts = 0                         # context shifts so far
        # code infilling's line rules (llama-server's n_indent, t_max_predict_ms): what was
        # generated, where the line being checked starts, and whether a line has ended
        self.text, self.line_at, self.had_newline, self.released = "", 0, False, 0

    @property
    def done(self) -> bool:
        return self.reason is not None

    def step(self, logits: np.ndarray) -> Token:
        """Choose the next token from `logits`; afterwards `done` says whether to stop."""
        p = self.params
        if self.t_first is None:
            self.t_first = time.perf_counter()
        allowed = self.constraint.apply(logits) if self.constraint else logits
        tid = self.sampler.sample(allowed, self.history)
        if self.constraint:
            self.constraint.accept(tid)
        lp, top = None, []
        if p.logprobs is not None:
            ls = log_softmax(logits)
            lp = float(ls[tid])
            if p.logprobs:
                best = np.argsort(-ls)[:p.logprobs]
                top = [(int(i), float(ls[i])) for i in best]
        self.n_out += 1
        self.history.append(tid)
        if tid in self.tok.special.stop_ids and not p.ignore_eos:
            self.reason = "stop"
            return Token(tid, "", lp, top, self.index)
        piece = self.decoder.feed(tid)
        self.pending += piece
        hit = min(((self.pending.find(s), s) for s in p.stop if s in self.pending), default=None)
        if hit is not None:
            text, self.pending, self.reason, self.stop_string = self.pending[:hit[0]], "", "stop", hit[1]
            return Token(tid, text, lp, top, self.index)
        if p.n_indent or p.t_max_predict_ms:
            self._line_rules(piece)
            if self.reason:
                text, self.pending = self.pending, ""
                self.released += len(text)
                return Token(tid, text, lp, top, self.index)
        release = len(self.pending) - max(_stop_hold(self.pending, p.stop), self._indent_hold())
        text, self.pending = self.pending[:release], self.pending[release:]
        self.released += len(text)
        if self.constraint and self.constraint.done:
            self.reason = "stop"                 # the grammar is complete: nothing may follow
            text, self.pending = text + self.pending + self.decoder.flush(), ""
        elif self.n_out >= p.max_tokens:
            self.reason = "length"
        return Token(tid, text, lp, top, self.index)

    def _line_rules(self, piece: str) -> None:
        """llama-server's rules for code completion, checked after each token: a new line
        indented less than `n_indent` ends the answer before its first non-blank character;
        once a line has ended, the answer ends when `t_max_predict_ms` have passed."""
        p = self.params
        self.text += piece
        if self.had_newline and p.n_indent and self.line_at > 0:
            pos = self.line_at
            while pos < len(self.text) and self.text[pos] in " \t":
                pos += 1
            if pos < len(self.text) and pos - self.line_at < p.n_indent:
                self.reason = "length"
                # cut at the line's first non-blank character (what was sent stays sent)
                self.pending = self.text[self.released:max(pos, self.released)]
                return
        if p.n_indent:
            nl = self.text.find("\n", self.line_at)
            if nl >= 0:
                self.line_at = nl + 1
        if self.had_newline and p.t_max_predict_ms and \
                (time.perf_counter() - self.t_first) * 1000 > p.t_max_predict_ms:
            self.reason = "length"
        if "\n" in piece:
            self.had_newline = True

    def _indent_hold(self) -> int:
        """With n_indent, a line that is still only blanks is held back: it may yet be cut."""
        if not self.params.n_indent:
            return 0
        nl = self.pending.rfind("\n")
        return len(self.pending) - nl - 1 if nl >= 0 and not self.pending[nl + 1:].strip(" \t") else 0

    def finish(self, reason: str | None = None) -> Finish:
        self.reason = reason or self.reason or "length"
        tail = "" if self.reason == "stop" else self.pending + self.decoder.flush()
        now = time.perf_counter()
        first = self.t_first or now
        return Finish(self.reason, self.n_prompt, self.n_out, self.cached, tail, first - self.t_start, now - first,
                      self.index, self.drafted, self.accepted, self.stop_string, self.shifts)

    def shift(self, model: Model, cache: KVCache, n_ctx: int) -> bool:
        """Before running the next token: shift the context if it is at its end (shift_plan).
        False when the context is full and nothing can go (the generation ends, "length")."""
        if cache.n + 1 < n_ctx:
            return True
        if not self.params.context_shift:
            return False
        n_keep, n_discard = shift_plan(cache.n, self.n_prompt, n_ctx, self.params, self.tok.special.add_bos)
        if n_discard <= 0:
            return False
        model.shift_cache(cache, n_keep, n_discard)
        self.shifts += 1
        return True


class Sequence:
    """One conversation's KV cache on a model; reuses the cached prefix across calls."""

    def __init__(self, model: Model, n_ctx: int | None = None):
        self.model = model
        self.n_ctx = n_ctx or model.config.n_ctx_train
        self.cache: KVCache = model.new_cache(self.n_ctx)

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        check_context(prompt, params, self.n_ctx, self.cache.can_shift and self.model.can_shift_over(prompt))

    def start(self, prompt: list[int], adapter=None) -> int:
        """Keep the cache's longest prefix shared with `prompt` (at least one token is left to
        run, for its logits); return how many positions were kept."""
        reuse = min(self.cache.common_prefix(prompt, adapter), len(prompt) - 1)
        self.cache.truncate(reuse)
        self.cache.adapter = adapter
        return reuse

    def prefill(self, prompt: list[int], cancelled: Callable[[], bool] = lambda: False,
                chunk: int = PREFILL_CHUNK, adapter=None) -> tuple[np.ndarray | None, int]:
        """Bring the cache to `prompt`, reusing its longest cached prefix; return the last
        position's logits (None if cancelled) and how many prompt tokens were reused.

        The new part runs in chunks, checking `cancelled` between them; on the compiled
        kernels chunking changes no bit of the result."""
        reuse = self.start(prompt, adapter)
        logits = None
        for start in range(reuse, len(prompt), chunk):
            if cancelled():
                return None, reuse
            logits = self.model.forward(prompt[start:start + chunk], self.cache, adapter=adapter)
        self.cache.checkpoint()              # recurrent layers: their states at the prompt's end
        return logits, reuse

    def generate(self, prompt: list[int], params: SamplingParams,
                 cancelled: Callable[[], bool] = lambda: False, adapter=None) -> Iterator[Token | Finish]:
        self.check(prompt, params)
        gen = Generation(self.model, prompt, params)
        logits, gen.cached = self.prefill(prompt, cancelled, adapter=adapter)
        if logits is None:
            yield gen.finish("cancelled")
            return
        while params.max_tokens > 0:
            if cancelled():
                yield gen.finish("cancelled")
                return
            tok = gen.step(logits)
            yield tok
            if gen.done:
                break
            if not gen.shift(self.model, self.cache, self.n_ctx):
                break
            logits = self.model.forward([tok.id], self.cache, adapter=adapter)
        yield gen.finish()


def score_prompt(model: Model, prompt: list[int], top: int = 0, chunk: int = PREFILL_CHUNK, adapter=None) -> dict:
    """Log-probability of every prompt token under the model (the first has none), with the
    top-n alternatives at each position — what evaluation harnesses ask for with echo=true.
    Runs in chunks, so a long prompt never holds more than one chunk of full logits."""
    cache = model.new_cache(len(prompt) + 1)
    token_lp: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    prev = None
    for start in range(0, len(prompt), chunk):
        part = prompt[start:start + chunk]
        logits = model.forward(part, cache, all_logits=True, adapter=adapter)
        rows = np.concatenate([prev[None], logits[:-1]]) if prev is not None else logits[:-1]
        targets = prompt[start + (0 if prev is not None else 1): start + len(part)]
        for row, t in zip(rows, targets):
            ls = log_softmax(row)
            token_lp.append(float(ls[t]))
            tops.append([(int(i), float(ls[i])) for i in np.argsort(-ls)[:top]] if top else [])
        prev = logits[-1]
    return {"token_logprobs": token_lp, "top_logprobs": tops}


def embed(model: Model, prompt: list[int], chunk: int = PREFILL_CHUNK, adapter=None,
          normalize: bool = True, pooling: str = "mean") -> np.ndarray:
    """The prompt's embedding from its final hidden states: their mean (llama-server's `--pooling
    mean`), the last one (`last`: Qwen3-Embedding) or the first (`cls`); L2-normalised unless
    `normalize=False` (the vector itself, as Ollama's legacy /api/embeddings returns). float32,
    (n_embd,)."""
    if pooling not in ("mean", "last", "cls"):
        raise ValueError(f"pooling {pooling!r}: a chat model embeds by mean, last or cls")
    cache = model.new_cache(len(prompt))
    total = np.zeros(model.config.n_embd, np.float64)
    for start in range(0, len(prompt), chunk):
        h = model.hidden(prompt[start:start + chunk], cache, adapter=adapter)
        if pooling == "mean":
            total += h.sum(axis=0, dtype=np.float64)
        elif pooling == "last" or start == 0:
            total = h[-1 if pooling == "last" else 0].astype(np.float64)
    vec = total / len(prompt) if pooling == "mean" else total
    if not normalize:
        return vec.astype(np.float32)
    norm = np.linalg.norm(vec)
    return (vec / norm if norm > 0 else vec).astype(np.float32)


def generate_text(model: Model, prompt: list[int], params: SamplingParams,
                  adapter=None) -> tuple[list[int], str, Finish]:
    """Run a whole generation; return (token ids, text, finish)."""
    ids, parts = [], []
    for ev in Sequence(model).generate(prompt, params, adapter=adapter):
        if isinstance(ev, Token):
            ids.append(ev.id)
            parts.append(ev.text)
        else:
            parts.append(ev.text)
            return ids, "".join(parts), ev
    raise AssertionError("generate() ended without a Finish")
