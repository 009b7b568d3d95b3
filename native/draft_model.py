"""Drafts from a second, smaller model: speculative decoding's classic form.

A model that shares the served model's vocabulary (SmolLM2-135M beside a larger SmolLM2, a
MoE-fied copy beside its dense base) guesses the next k tokens greedily from its own KV cache;
the scheduler checks them in one forward of the served model and keeps them as far as its own
choices match (native/scheduler.py) — so, as with prompt lookup, the text is exactly what plain
decoding gives, only the number of served-model forwards changes. The draft's cache follows the
text: before each draft it is cut back to what it shares with the history and the rest is fed.
"""

from __future__ import annotations

import time

import numpy as np

from .kv_cache import KVCache
from .model import Model
from .speculate import ema
from .vocabulary import vocabulary_difference


class DraftModelError(ValueError):
    """The draft model cannot draft for this model; the message says why."""


class DraftState:
    """One sequence's draft cache, and how much of the history it is known to hold."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.synced = 0


class DraftModel:
    def __init__(self, model: Model, target: Model):
        differ = vocabulary_difference(model, target)
        if differ:
            raise DraftModelError(
                f"draft model {model.path.name} cannot draft for {target.path.name}: their vocabularies "
                f"differ ({differ}); a draft model must use the same tokenizer (e.g. a smaller model of the "
                f"same family)")
        if not model.new_cache(8).can_rewind:
            raise DraftModelError(f"draft model {model.path.name} cannot draft: its cache cannot be rolled back "
                                  f"(recurrent or sliding-window layers); use a plain transformer")
        self.model = model
        self.step_s: float | None = None        # one draft token's forward (moving average)

    def new_state(self, n_ctx: int) -> DraftState:
        return DraftState(self.model.new_cache(n_ctx))

    def cost_per_token(self, target_step_s: float | None) -> float | None:
        """A draft token's cost in served-model steps (None until both are measured)."""
        if self.step_s is None or not target_step_s:
            return None
        return self.step_s / target_step_s

    def propose(self, state: DraftState, history: list[int], k: int) -> list[int]:
        """k tokens the draft model would choose (greedily) after `history`."""
        if k <= 0 or not history:
            return []
        cache = state.cache
        # the cache holds history[:synced] plus the last draft: keep what still matches
        n = min(cache.n, len(history) - 1)           # the last token is always fed again
        common = state.synced
        if n > common:
            have = np.asarray(cache.tokens[common:n]), np.asarray(history[common:n])
            diff = np.flatnonzero(have[0] != have[1])
            common = n if not len(diff) else common + int(diff[0])
        common = min(common, n)
        cache.truncate(common)
        t0 = time.perf_counter()
        logits = self.model.forward(history[common:], cache)
        out = [int(np.argmax(logits))]
        for _ in range(k - 1):
            logits = self.model.forward([out[-1]], cache)
            out.append(int(np.argmax(logits)))
        self.step_s = ema(self.step_s, (time.perf_counter() - t0) / k)
        state.synced = len(history)
        return out
