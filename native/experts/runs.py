"""How the forward takes a layer's experts from the expert cache (a part of ExpertCache,
native/experts/cache.py): the resident experts first, then — after the forward has read ahead
from what it has — each remaining expert as its read arrives; the wait counted; nothing left
pinned when a read fails."""

from __future__ import annotations

import time
from ..kernels import Weight


class LayerRuns:
    """Mixed into ExpertCache: uses its requests, pending reads and views."""

    def arrivals(self, layer: int, reads: dict):
        """The experts of `reads` ({expert: its read}) in the order their reads end, each made
        resident as it arrives; the time blocked counts as the forward's wait."""
        waiting = dict(reads)
        while waiting:
            self.io.collect(0.0)
            ready = [e for e, r in waiting.items() if r.completed]
            if not ready:
                t0 = time.perf_counter()
                self.io.wait_any(waiting.values())
                self.wait_seconds += time.perf_counter() - t0
                continue
            for e in ready:
                fut = waiting.pop(e)
                self._wait((layer, e))           # placed — or dropped, raising the read's error
                if fut.exception() is not None:  # dropped before by a _reap: still this forward's error
                    raise fut.exception()
                yield e

    def _in_arrival_order(self, layer: int, group: list[int], before_wait=None):
        """`group` (requested) in batches ready to compute: the resident experts, then — after
        before_wait() — each of the others as its read arrives."""
        self._reap()
        late = {e: self.pending[(layer, e)] for e in group if (layer, e) in self.pending}
        yield [e for e in group if e not in late]
        if before_wait is not None:
            before_wait()
        for e in self.arrivals(layer, late):
            yield [e]

    def run_layer(self, layer: int, experts, compute, rows: int = 0, before_wait=None) -> dict:
        """compute(e, (gate, up, down)) for each of a layer's experts: the resident ones first,
        then `before_wait(results so far)` (the forward reads ahead from the partial output while
        the disk is still busy with this layer), then the others as their reads complete. More
        experts than the cache holds (a prompt's chunk) are taken in waves, each expert read
        once, the next wave's reads overlapping this wave's compute. Returns {expert: result}."""
        experts = [int(e) for e in experts]
        wave = len(experts) if len(experts) <= self.slots else max(1, self.slots // 2)
        waves = [experts[i:i + wave] for i in range(0, len(experts), wave)]
        out = {}
        try:
            self.request(layer, waves[0], rows)
            for n, group in enumerate(waves):
                if n + 1 < len(waves):
                    self.request(layer, waves[n + 1])
                hook = (lambda: before_wait(out)) if n == 0 and before_wait is not None else None
                for batch in self._in_arrival_order(layer, group, hook):
                    for e in batch:
                        out[e] = compute(e, self._weights_at(layer, e))
                self.release(layer, group)
        finally:                                 # a failed read: nothing of this layer stays pinned
            self.release(layer, experts)
        return out

    def run_ready(self, layer: int, experts, step, rows: int = 0, before_wait=None) -> None:
        """A layer's experts (no more than the slots hold) computed by `step()` — compiled: it
        computes what the address table holds and returns how many are left — first over the
        resident ones, then `before_wait()` (the forward reads ahead while this layer's misses
        are read), then again as each read arrives."""
        experts = [int(e) for e in experts]
        try:
            self.request(layer, experts, rows)
            for _ in self._in_arrival_order(layer, experts, before_wait):
                left = step()
            if left:
                raise RuntimeError(f"layer {layer}: {left} chosen experts never became resident")
        finally:
            self.release(layer, experts)

    def prefetch(self, layer: int, experts, rows: int = 0) -> None:
        """Make `experts` of `layer` resident and wait for them (not pinned)."""
        want = list(experts)[:self.slots]
        self.request(layer, want, rows, pin=False)
        for e in want:
            self._wait((layer, int(e)))

    def weights(self, layer: int, e: int) -> tuple[Weight, Weight, Weight]:
        key = (layer, int(e))
        if key not in self.index:
            self.request(layer, [e], pin=False)
        fut = self.pending.get(key)
        self._wait(key)                          # raises the read's error
        if key not in self.index:                # failed, and dropped by a _reap before this wait
            raise (fut.exception() if fut is not None and fut.exception() is not None
                   else OSError(f"expert {e} of layer {layer} could not be read: {self.last_read_error}"))
        return self._weights_at(layer, int(e))

    def _weights_at(self, layer: int, e: int) -> tuple[Weight, Weight, Weight]:
        slot = self.index[(layer, e)]
        v = self.views[slot]
        if not v:                                # made on first use (the compiled path needs none)
            v = self.views[slot] = self._views(layer, e, slot)
        return v["gate"], v["up"], v["down"]
