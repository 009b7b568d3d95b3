"""A model split by layer ranges across processes (a pipeline): which layers each stage holds, and
a later stage's KV caches of the sequences the first stage runs.

The first stage embeds the tokens, runs its layers, hands the rows to the next stage and computes
the logits from what comes back (native/model.py's `remote`); each later stage runs its layers
over the rows it is sent. Each keeps the KV cache of its own layers. A sequence is named by its
first-stage cache's uid, and every call says at which position the rows start, so a first stage
that forgot positions (a follow-up turn reusing a prefix, a speculative draft rejected) is
mirrored without a message of its own: a later stage drops what it holds past that position.
Bits: the same kernels on the same rows — a split model's logits equal the whole model's.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class StageStateLost(ValueError):
    """A later stage no longer holds what a sequence's rows need (it restarted, or evicted it)."""


def stage_layers(n_layer: int, index: int, count: int) -> tuple[int, int]:
    """Layers first..end-1 of stage `index` of `count`: an equal share each, the first stage's
    rounded down (it also computes the embeddings and the logits)."""
    if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count <= n_layer):
        raise ValueError(f"stage {index} of {count}: a model of {n_layer} layers splits into 1..{n_layer} "
                         f"stages, numbered from 0")
    return n_layer * index // count, n_layer * (index + 1) // count


class StageCaches:
    """A later stage's caches by sequence uid, least recently used dropped past `capacity` (the
    first stage's sequences: its parallel slots and a few more)."""

    def __init__(self, model, n_ctx: int, capacity: int):
        self.model, self.n_ctx, self.capacity = model, n_ctx, capacity
        self.caches: OrderedDict = OrderedDict()
        self.evicted = 0

    def segments(self, seqs: list) -> list:
        """(cache, first row, end row) of each [uid, start, rows], each cache cut back to `start`."""
        for item in seqs:                      # every one checked before any cache changes
            if not (isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], str)
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item[1:]) and item[2] > 0):
                raise ValueError(f"a sequence is [uid, start, rows], got {str(item)[:80]}")
            if item[1] + item[2] > self.n_ctx:
                raise ValueError(f"sequence {item[0]}: {item[1] + item[2]} positions exceed the context ({self.n_ctx})")
        if not seqs or len({item[0] for item in seqs}) != len(seqs):
            raise ValueError("a call names one or more sequences, each once")
        out, at = [], 0
        for uid, start, rows in seqs:
            cache = self.caches.get(uid)
            if cache is None:
                if start:
                    raise StageStateLost(f"this stage holds nothing of sequence {uid} (it restarted or dropped "
                                         f"it) and it starts at {start}")
                cache = self.caches[uid] = self.model.new_cache(self.n_ctx)
                while len(self.caches) > self.capacity:
                    self.caches.popitem(last=False)
                    self.evicted += 1
            self.caches.move_to_end(uid)
            if cache.n < start:
                raise StageStateLost(f"sequence {uid} starts at {start}, this stage holds {cache.n} positions")
            cache.truncate(start)
            out.append((cache, at, at + rows))
            at += rows
        return out

    def run(self, x: np.ndarray, seqs: list, keep: list | None) -> np.ndarray:
        """Everything checked — rows, sequences, `keep` — before any cache changes."""
        rows = sum(s[2] for s in seqs if isinstance(s, (list, tuple)) and len(s) == 3 and isinstance(s[2], int))
        if x.shape[0] != rows:
            raise ValueError(f"{x.shape[0]} rows for sequences of {rows}")
        picked = slice(None) if keep is None else np.asarray(keep, np.intp)
        if keep is not None and (picked.ndim != 1 or (len(picked) and (picked.min() < 0 or picked.max() >= rows))):
            raise ValueError("keep names rows outside the batch")
        segs = self.segments(seqs)
        return np.ascontiguousarray(self.model.run_stage(x, segs, picked))

    @property
    def positions(self) -> int:
        return sum(c.n for c in self.caches.values())
