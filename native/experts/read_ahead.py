"""The expert cache's guesses for later layers: which to read, how they are scored, and the
guesses dropped when their layer chose otherwise (a part of ExpertCache, native/experts/cache.py).

The forward predicts a layer's experts before it routes (native/experts/source.py) and hands the
ranked guesses to `read_ahead`; when the layer routes, `_score_read_ahead` scores them.
"""

from __future__ import annotations

import numpy as np

from .io import AHEAD, CHUNK_BYTES


class ReadAhead:
    """Mixed into ExpertCache: uses its index, pending reads, policy and eviction."""

    def _init_read_ahead(self) -> None:
        self.speculative: dict[tuple[int, int], bool] = {}  # key read ahead -> used since
        self.predicted: dict[int, set[int]] = {}
        self.spec_reads = self.spec_used = self.spec_wasted_bytes = 0
        self.spec_cancelled = 0                              # guesses cancelled before their reads began
        self.recall_hits = self.recall_total = 0
        self.ra_issued: dict[int, set[int]] = {}           # layer -> experts read ahead for it
        self.ra_guesses: dict[int, dict[int, int]] = {}    # layer -> {expert not resident: its rank}
        self.ra_rank_kept: dict[int, float] = {}            # rank -> decayed rate its guesses were used
        self.read_ahead_on = True

    def read_ahead(self, layer: int, ranked) -> None:
        """Start reading the experts a later layer is predicted to use — `ranked`: (rows, n)
        expert ids, most likely first — at the ranks whose guesses have been used often enough
        to pay for their reads; never evicts what is in use or in flight, and gives up quietly
        when nothing else may go."""
        ranked = np.atleast_2d(np.asarray(ranked))
        best: dict[int, int] = {}                            # expert -> its best rank over the rows
        for r in range(ranked.shape[1]):
            for e in ranked[:, r].tolist():
                best.setdefault(int(e), r)
        self.predicted[layer] = set(best)
        guesses = self.ra_guesses[layer] = {e: r for e, r in best.items() if (layer, e) not in self.index}
        if not self.read_ahead_on:
            return
        issued = self.ra_issued.setdefault(layer, set())
        for e, r in guesses.items():
            if self.ra_rank_kept.get(r, 1.0) < self.RA_MIN_PRECISION:
                continue
            slot = self._evict_for(speculative=True)
            if slot is None:
                return
            key = (layer, e)
            self.index[key] = slot
            self._submit(key, slot, AHEAD)
            self.speculative[key] = False
            self.spec_reads += 1
            issued.add(e)
            self.policy.admit(key)

    RA_MIN_PRECISION, RA_DECAY = 0.6, 0.95

    def _score_read_ahead(self, layer: int, want) -> None:
        """Score the guesses made for `layer` now that it routed. When the disk is the limit a
        wrong guess costs a read some layer needed, and the guesses' worth falls with their rank
        (bench model, next layer predicted from the partial output: used 0.90, 0.77, 0.61,
        0.45, 0.32 of the time at ranks 1-5): every guess of a non-resident expert, read or
        not, updates its rank's decayed rate, and a rank below RA_MIN_PRECISION is not read.
        Guesses read ahead and not chosen are cancelled if their reads have not started."""
        want = set(want)
        for e, r in self.ra_guesses.pop(layer, {}).items():
            self.ra_rank_kept[r] = self.ra_rank_kept.get(r, 1.0) * self.RA_DECAY + (1 - self.RA_DECAY) * (e in want)
        for e in self.ra_issued.pop(layer, set()) - want:
            self._cancel((layer, e))

    def _cancel(self, key: tuple[int, int]) -> None:
        """A guess its layer did not choose: if its read is still queued or running, skip what
        has not started and free the slot once nothing writes to it any more."""
        read = self.pending.get(key)
        if read is None or self.speculative.get(key) is not False or read.done():
            return
        started = read.cancel()                              # chunks already read or being read
        self.spec_cancelled += not started
        self.spec_wasted_bytes += min(self.slot_bytes, started * CHUNK_BYTES)
        slot = self.index.pop(key)
        del self.pending[key]
        self.policy.remove(key)
        self.speculative.pop(key)
        self.cancelling.append((read, slot))

    def read_ahead_stats(self) -> dict:
        return {"reads": self.spec_reads, "used": self.spec_used,
                "used_by_rank": [round(self.ra_rank_kept[r], 3) for r in sorted(self.ra_rank_kept)],
                "cancelled": self.spec_cancelled, "wasted_bytes": self.spec_wasted_bytes,
                "recall": round(self.recall_hits / self.recall_total, 4) if self.recall_total else None}
