"""Perplexity of a model on a text, computed the way llama.cpp's `llama-perplexity` does:
tokens without BOS (unless the model adds one), non-overlapping chunks of n_ctx tokens, each
evaluated alone, and for positions j = n_ctx/2 … n_ctx-2 of a chunk the negative
log-likelihood of token j+1 under the logits at j. PPL = exp(mean NLL) ± PPL·std/√n."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .model import Model


@dataclass
class PerplexityResult:
    ppl: float
    ppl_err: float
    n_chunks: int
    n_scored: int
    n_ctx: int
    chunk_ppl: list[float] = field(default_factory=list)


def perplexity(model: Model, text: str, n_ctx: int = 512,
               progress: Callable[[int, int, float], None] | None = None,
               max_chunks: int | None = None) -> PerplexityResult:
    """`max_chunks`: score only the first chunks (llama-perplexity's --chunks)."""
    ids = model.tokenizer.encode(text, special=False)
    n_chunks = len(ids) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise ValueError(f"the text has {len(ids)} tokens; perplexity needs at least n_ctx = {n_ctx}")
    first = n_ctx // 2
    nll: list[float] = []
    chunk_ppl = []
    for i in range(n_chunks):
        chunk = ids[i * n_ctx:(i + 1) * n_ctx]
        logits = model.forward(chunk, model.new_cache(n_ctx), logits_from=first)[:-1].astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits).sum(axis=1))
        targets = np.asarray(chunk[first + 1:])
        chunk_nll = logz - logits[np.arange(len(targets)), targets]
        nll.extend(chunk_nll.tolist())
        running = math.exp(float(np.mean(nll)))
        chunk_ppl.append(running)
        if progress:
            progress(i + 1, n_chunks, running)
    arr = np.asarray(nll)
    ppl = math.exp(float(arr.mean()))
    return PerplexityResult(ppl, ppl * float(arr.std()) / math.sqrt(len(arr)), n_chunks, len(arr), n_ctx, chunk_ppl)
