"""The expert cache: streamed experts kept in fixed slots of one page-aligned buffer.

`ExpertCache` holds a number of slots (one expert's three projections each), evicted by a policy
of native/experts/policy.py (default `lrfu`, frequency-recency: bench/moe_stream.py replays routing
traces to compare them). Reads are asynchronous — each projection its own read on a few I/O
threads (native/experts/io.py: the reads the forward waits for first, then the guesses for the next
layer, then filling free slots; a guess its layer did not choose is dropped if not yet read) — and
`run_layer` computes the experts already resident while the rest arrive. `Weight`s are views of
the slot: the kernels multiply them in place, and the layer's sum is taken in the in-RAM order, so
a streamed forward computes the same bits as the in-RAM one. A decode step whose chosen experts
are all resident runs in the one-call compiled decode with `table`, the slots' addresses.
"""

from __future__ import annotations

import time

import numpy as np

from ..gguf_file import GGUFFile
from ..kernels import Weight
from .io import CHUNK_BYTES, DEMAND, FILL, PART_MASK, ExpertRead, ReadQueue
from .memory import Placement, huge_page_bytes, place, private_buffer
from .policy import make_policy
from .read_ahead import ReadAhead
from .runs import LayerRuns
from .slots import ENTRY_BYTES, READY, Slots
from .store import ExpertStore
from .warm import WarmStart


def budget_for(slots: int, slot_bytes: int) -> int:
    """The expert_cache budget that segment_bytes turns into `slots` slots (its inverse): what a
    measured cache of that many slots is to be asked for (native/models/tune.py)."""
    return 4096 + slots * (slot_bytes + ENTRY_BYTES)


def segment_bytes(g: GGUFFile, store: ExpertStore, budget: int) -> tuple[int, int]:
    """(slots, total bytes) of a cache segment that fits in `budget` bytes — no more slots than
    the model has experts (a budget of 25 % of RAM for a small MoE holds all of them)."""
    probe = ExpertCache.__new__(ExpertCache)
    probe._geometry(g, store)
    per_slot = probe.slot_bytes + ENTRY_BYTES
    slots = min(probe.expert_count, max(1, (budget - 4096) // per_slot))
    used = int(g.metadata.get(f"{g.architecture}.expert_used_count") or 1)
    if slots < used:                  # one layer's chosen experts must be resident together
        raise ValueError(f"an expert cache of {budget / 2**20:.2f} MiB holds {slots} expert(s) of {g.path.name}, "
                         f"which uses {used} per token in a layer: give expert_cache at least "
                         f"{(4096 + used * per_slot) / 2**20:.2f} MiB")
    return int(slots), int(ExpertCache.index_bytes(slots) + slots * probe.slot_bytes)


def mean_depth(depth_seconds: list[float]) -> float | None:
    """Mean chunks in flight while any was (the last bucket counts as its own depth)."""
    total = sum(depth_seconds)
    return round(sum((i + 1) * s for i, s in enumerate(depth_seconds)) / total, 2) if total > 0 else None


class ExpertCache(Slots, ReadAhead, LayerRuns, WarmStart):
    """Experts in fixed, page-aligned slots; each slot holds gate, up and down. An expert the
    current layer uses, or whose read is in flight, is never evicted.

    With `buffer` (a shared-memory segment the supervisor owns) the cache keeps an index at the
    start of it: a slot is marked ready, with its (layer, expert), use sequence and CRC32, only
    after its read completes. A restarted worker re-attaches, re-checks every ready slot's CRC32
    and starts warm; a segment made for another model or geometry is reset (native/experts/slots.py)."""

    def __init__(self, g: GGUFFile, store: ExpertStore, slots: int, threads: int = 4, buffer=None,
                 policy: str = "lrfu", pinned=(), placement: Placement | None = None):
        self.policy = make_policy(policy, pinned)
        self._geometry(g, store)
        self.store = store
        self.slots = max(1, slots)
        head = self.index_bytes(self.slots)
        if buffer is None:                       # private memory in huge pages (native/experts/memory.py)
            buffer = private_buffer(head + self.slots * self.slot_bytes)
            placement = placement or place("private", None)
        self.placement = placement or Placement("shared", False, "a buffer the caller gave")
        if len(buffer) < head + self.slots * self.slot_bytes:
            raise ValueError(f"cache buffer of {len(buffer)} bytes is too small for {self.slots} slots")
        self.buffer = buffer
        self.data = memoryview(buffer)[head:]                              # slots start page-aligned
        self.data_address = np.frombuffer(self.data, np.uint8).ctypes.data
        self.addresses: dict[int, list[int]] = {}                          # slot -> its projections' addresses
        self._open_index(g, buffer)
        self.index: dict[tuple[int, int], int] = {}                        # (layer, expert) -> slot
        self.views: dict[int, dict[str, Weight]] = {}
        self.pending: dict[tuple[int, int], ExpertRead] = {}               # reads in flight
        self.cancelling: list[tuple[ExpertRead, int]] = []                 # (read, its slot) being cancelled
        self.busy: set[tuple[int, int]] = set()                            # in use by the current layer
        self.io = ReadQueue(store, threads, self.slots, sum(-(-b // CHUNK_BYTES) for b in self.part_bytes.values()))
        self.tokens = 0                                                    # rows routed through layer 0
        self.hits = self.misses = 0
        self.wait_seconds = 0.0           # time the forward waited for reads (I/O not hidden by compute)
        self.seq = 0
        # next-layer prediction (Model asks; the cache keeps the score)
        self.inflight_hits = 0
        self.read_errors, self.last_read_error = 0, None
        self._init_read_ahead()
        self._init_warm()
        self._filling: set = set()
        self._fill_order = ((layer, e) for layer in sorted({k[0] for k in self.map}) for e in range(self.n_expert))
        self.fill_reads, self.free_fill_done = 0, False
        # per layer, where each resident expert's projections are: a layer whose experts are all
        # resident runs in the one-call compiled decode with this table
        n_layers = 1 + max(layer for layer, _ in self.map)
        self.table = np.zeros((n_layers, self.n_expert, 3), np.uint64)
        self.resident = np.zeros(n_layers, np.int64)
        self.resident_count = 0
        self.all_resident = False                # every expert of the model in the cache
        self.warm_slots = self._attach()
        self.free = [i for i in range(self.slots) if i not in set(self.index.values())]

    # -- reads (native/experts/io.py) ---------------------------------------------------------------

    @property
    def bytes_read(self) -> int:
        return self.io.stats()["bytes"]

    @property
    def read_seconds(self) -> float:
        """Wall time with at least one read in flight (the disk busy)."""
        return self.io.stats()["busy_seconds"]

    @property
    def read_depth_seconds(self) -> list[float]:
        """Seconds with 1, 2, ... chunks in flight: how deep the disk's queue was while reading."""
        return self.io.stats()["depth_seconds"]

    def _submit(self, key: tuple[int, int], slot: int, priority: int = DEMAND) -> ExpertRead:
        """Read an expert's three projections, in chunks, in parallel; the read completes (with
        its views) after the last, when the slot's index entry is marked ready."""
        layer, e = key
        self.entries[slot]["state"] = 0                      # not valid until fully read

        def finish() -> dict:
            ent = self.entries[slot]
            ent["layer"], ent["expert"] = layer, e
            ent["crc"] = self._fingerprint(slot)
            ent["state"] = READY
            return self._ready(layer, e, slot)
        parts, spans = [], []
        for p, off, n, base in self._layout(layer, e, slot):
            start, size = self.store.span(off, n)
            parts.append((start, size, off - start + n, self.data_address + base))
            spans.append((start, start + size, p, off, n))

        def describe(at: int, exc: OSError) -> OSError:     # say which expert, where: the disk's words alone do not
            _, _, p, off, n = next((sp for sp in spans if sp[0] <= at < sp[1]), spans[0])
            part = self.map[(layer, p)].part
            return OSError(exc.errno, f"reading expert {e} of layer {layer} ({self.map[(layer, p)].name}, "
                                      f"{n} bytes at {off & PART_MASK}) from {self.store.paths[part]}: "
                                      f"{exc.strerror or exc}")
        read = self.pending[key] = self.io.submit(slot, priority, parts, finish, describe)
        return read

    # -- residency (in the forward's thread) ------------------------------------------------------

    def _evict_for(self, speculative: bool) -> int | None:
        """A slot for a new expert: a free one, else the policy's victim (never busy, pinned or
        in flight). None for a read-ahead when nothing may go; a demand read waits for reads in
        flight and then takes any slot not in use by this layer."""
        if self.free:
            return self.free.pop()
        self._reap()
        key = self.policy.victim(self.busy | set(self.pending))
        if key is None:
            if speculative:
                return None
            for fut in list(self.pending.values()):
                fut.exception()                  # wait; a failure is dropped and counted by _reap
            for fut, _ in self.cancelling:
                fut.exception()
            self._reap()
            if self.free:
                return self.free.pop()
            key = self.policy.victim(self.busy)
            if key is None:
                raise RuntimeError(f"expert cache of {self.slots} slots has no slot to evict "
                                   f"({len(self.busy)} experts in use)")
        slot = self.index.pop(key)
        self.policy.remove(key)
        if self.views.pop(slot, None) is not None:
            self._placed(key, None)
        if self.speculative.pop(key, True) is False:         # read ahead and never used
            self.spec_wasted_bytes += self.slot_bytes
        return slot

    def _reap(self) -> None:
        """Finished reads become resident: placed in the address table, evictable again; the
        slots of cancelled reads that have stopped are free again. A read that failed and that
        no forward is waiting for is dropped (counted in `read_errors`): the next request for
        that expert reads it again, so one bad moment of the disk fails only the forward that
        waited for it."""
        if self.pending or self.cancelling:
            self.io.collect(0.0)
        if self.pending:
            # a failed read the current layer waits for stays, for the layer to raise its error
            for k in [k for k, fut in self.pending.items()
                      if fut.completed and (k not in self.busy or fut.exception() is None)]:
                try:
                    self._wait(k)
                except Exception:                # noqa: BLE001 — recorded by _wait
                    pass
        if self.cancelling:
            still = []
            for fut, slot in self.cancelling:
                if fut.completed:
                    self.free.append(slot)
                else:
                    still.append((fut, slot))
            self.cancelling = still

    def _wait(self, key: tuple[int, int]) -> None:
        fut = self.pending.pop(key, None)
        if fut is None:
            return
        t0 = time.perf_counter()
        try:
            self.views[self.index[key]] = views = fut.result()
            self._placed(key, views)
        except BaseException as exc:
            slot = self.index.pop(key)
            self.policy.remove(key)
            self.free.append(slot)
            self.speculative.pop(key, None)
            self.read_errors += 1
            self.last_read_error = str(exc)
            raise
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def _placed(self, key: tuple[int, int], views: dict | None) -> None:
        layer, e = key
        if views is None:
            self.table[layer, e] = 0
            self.resident[layer] -= 1
            self.resident_count -= 1
        else:
            self.table[layer, e] = self.addresses[self.index[key]]
            self.resident[layer] += 1
            self.resident_count += 1
        self.all_resident = self.resident_count == self.expert_count

    def used(self, layer: int, chosen: np.ndarray, rows: int = 0) -> None:
        """The compiled decode used these resident experts: count the hits, tell the policy."""
        flat = chosen.ravel().tolist()
        want = flat if len(flat) == chosen.shape[-1] else sorted(set(flat))   # one row's top-k are distinct
        if self.all_resident:                    # nothing can miss, so nothing is evicted: the policy
            if layer == 0:                       # need not hear of it (the hit path's only cost)
                self.tokens += rows
            self.hits += len(want)
            return
        self._begin_layer(layer, want, rows)
        self._fill_idle()
        for e in want:
            key = (layer, e)
            self._hit(key)
            self._touch(key)

    def _begin_layer(self, layer: int, want: list[int], rows: int) -> None:
        """A layer routes `want`: count its rows (at layer 0), score the guess made for it."""
        if layer == 0 and rows:
            self.tokens += rows
            self.policy.tick(rows)
            self._note_hot()
        guess = self.predicted.pop(layer, None)
        if guess is not None:
            self.recall_total += len(want)
            self.recall_hits += sum(e in guess for e in want)
        self._score_read_ahead(layer, want)

    def _hit(self, key: tuple[int, int]) -> None:
        self.hits += 1                                       # per expert per layer
        if self.speculative.get(key) is False:               # read ahead, and now used
            self.speculative[key] = True
            self.spec_used += 1

    def _touch(self, key: tuple[int, int]) -> None:
        self.seq += 1
        self.policy.touch(key)
        self.entry_seq[self.index[key]] = self.seq

    def request(self, layer: int, experts, rows: int = 0, pin: bool = True) -> None:
        """Make `experts` of `layer` resident (reads start now, in parallel, and are not waited
        for: `weights` waits). `pin`: keep them until `release` (the layer is computing with
        them). `rows`: how many tokens this layer routes (counted at layer 0)."""
        want = [int(e) for e in experts]
        self._reap()
        self._begin_layer(layer, want, rows)
        keys = [(layer, e) for e in want]
        protect = set(keys) - self.busy          # no key of this request evicts another
        self.busy |= protect
        try:
            for key in keys:
                if key in self.index:
                    self._hit(key)
                    if key in self.pending:                  # a guess or a fill still in flight
                        self.inflight_hits += 1
                        self.pending[key].hurry(DEMAND)
                else:
                    self.misses += 1
                    slot = self._evict_for(speculative=False)
                    self.index[key] = slot
                    self._submit(key, slot)
                self._touch(key)
        finally:
            if not pin:
                self.busy -= protect
        self._fill_idle()

    FILL_IN_FLIGHT = 2

    def _fill_idle(self) -> None:
        """Free slots are read full while the disk has nothing else to do — one layer's experts
        after another — so a cache as large as the experts reaches in-RAM speed without waiting
        for the routing to ask for each expert once. Never evicts; never more than
        FILL_IN_FLIGHT reads at a time, and only when no read the forward waits for is out."""
        if not self.free:
            return
        self._reap()
        if any(k not in self._filling for k in self.pending):
            return
        self._filling &= set(self.pending)
        while self.free and len(self._filling) < self.FILL_IN_FLIGHT:
            key = next((k for k in self._fill_order if k not in self.index), None)
            if key is None:
                self.free_fill_done = True
                return
            slot = self.free.pop()
            self.index[key] = slot
            self._submit(key, slot, FILL)
            self._filling.add(key)
            self.fill_reads += 1
            self.policy.admit(key)

    def release(self, layer: int, experts) -> None:
        for e in experts:
            self.busy.discard((layer, int(e)))

    def close(self) -> None:
        for fut in [*self.pending.values(), *(f for f, _ in self.cancelling)]:
            fut.exception()
        self.io.close()

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"io_mode": self.store.io_mode, "fallback_reason": self.store.fallback_reason,
                "memory": self.placement.kind, "warm_restart": self.placement.warm_restart,
                "memory_why": self.placement.why, "huge_page_bytes": huge_page_bytes(self.data_address),
                "slots": self.slots, "used": self.resident_count, "reading": len(self.pending),
                "warm_slots_at_start": self.warm_slots,
                "slot_bytes": self.slot_bytes, "cache_bytes": self.slots * self.slot_bytes,
                "hits": self.hits, "misses": self.misses,
                "hit_rate": round(self.hits / total, 4) if total else None, "bytes_read": self.bytes_read,
                "read_gb_s": round(self.bytes_read / self.read_seconds / 1e9, 3) if self.read_seconds else None,
                "read_queue_depth": mean_depth(self.read_depth_seconds),
                "policy": self.policy.name, "tokens": self.tokens,
                "io_ms_per_token": round(1000 * self.wait_seconds / self.tokens, 3) if self.tokens else None,
                "read_ms_per_token": round(1000 * self.read_seconds / self.tokens, 3) if self.tokens else None,
                "bytes_read_per_token": round(self.bytes_read / self.tokens) if self.tokens else None,
                "hits_in_flight": self.inflight_hits, "fill_reads": self.fill_reads,
                "read_errors": self.read_errors, "last_read_error": self.last_read_error,
                "preloaded_at_start": self.preloaded, "read_ahead": self.read_ahead_stats()}
