"""Prompt-lookup speculative decoding: drafts from the text itself, no second model.

When the last few tokens already occurred earlier in the conversation (code being rewritten, a
document being quoted), the tokens that followed them then are a good guess for what follows
now. The scheduler runs the guess through the model in one forward together with the token just
chosen, then samples each position from the model's own logits exactly as plain decoding would
— the same sampler, the same random draws — and keeps the guess only as far as it matches. So
the text is identical to plain decoding (greedy or seeded sampling alike, since a multi-token
forward gives the same bits as one token at a time on every kernel path); only the number of
forwards changes. A draft that keeps failing turns itself off for a while: a rejected draft
costs a larger forward for one token.
"""

from __future__ import annotations

import numpy as np

MIN_NGRAM, MAX_NGRAM = 2, 4
MAX_DRAFT = 16


def propose(history: list[int], k: int, window: int = 4096) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the history's last
    n tokens (the longest n in MAX_NGRAM..MIN_NGRAM that occurs); [] when none does."""
    if k <= 0 or len(history) < MIN_NGRAM + 1:
        return []
    h = np.asarray(history[-window:], dtype=np.int64)
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if len(h) <= n:
            continue
        tail = h[-n:]
        # starts i (i + n < len) where h[i:i+n] == tail, latest first
        hits = np.flatnonzero(h[:len(h) - n] == tail[0])
        for i in hits[::-1]:
            if i + n < len(h) and np.array_equal(h[i:i + n], tail):
                draft = h[i + n:i + n + k]
                if len(draft):
                    return [int(t) for t in draft]
    return []


class DraftControl:
    """How long a draft to try next, and whether to try at all — from what was accepted and
    what it cost. A draft of k tokens makes the forward cost more (on two cores a row of a
    small-model forward is compute-bound: ~6 ms a row on top of a ~16 ms step), so drafting
    pays only when enough of it is kept: the time per token produced by drafting steps is
    compared with a plain step's, and drafting pauses when it is not faster."""

    def __init__(self, k: int = 4):
        self.k = k
        self.rate = 1.0               # moving average of the accepted share of a draft
        self.cooldown = 0             # steps to skip drafting after poor acceptance
        self.drafted = self.accepted = 0
        self.per_token: float | None = None     # seconds per token produced while drafting

    def want(self) -> int:
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int, seconds: float = 0.0, produced: int = 0,
               plain_step: float | None = None) -> None:
        if drafted == 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.rate = 0.7 * self.rate + 0.3 * (accepted / drafted)
        self.k = min(MAX_DRAFT, self.k * 2) if accepted == drafted else max(2, accepted + 1)
        if produced:
            t = seconds / produced
            self.per_token = t if self.per_token is None else 0.7 * self.per_token + 0.3 * t
        slower = plain_step is not None and self.per_token is not None and self.per_token > 0.95 * plain_step
        if self.rate < 0.3 or slower:
            self.cooldown, self.rate, self.per_token = 32, 0.5, None   # pause, then probe again
