"""Streaming MoE experts from disk: where each expert lives, how it is read, where it is kept.

- `expert_map`: from the GGUF tensor table, the file byte range of every (layer, expert,
  projection) slice of `ffn_{gate,up,down}_exps` — the expert is the outermost dimension, so each
  slice is contiguous; starts are only 32-byte aligned.
- `ExpertStore`: reads slices with `O_DIRECT` — the aligned superset of the range, into
  page-aligned memory, with `os.preadv` — so streamed experts do not fill the page cache. Where
  O_DIRECT is refused (EINVAL at open or read: tmpfs, overlayfs) it falls back to buffered
  `preadv` + `posix_fadvise(DONTNEED)` and says so in `io_mode`; never silently.
- `ExpertCache`: a fixed number of slots (one expert's three projections each) in one page-aligned
  buffer, LRU eviction, hit/miss/byte/time counters. `weights(layer, expert)` returns `Weight`s
  whose blocks are views of the slot: the kernels multiply them in place, so a streamed forward
  pass computes the same bits as the in-RAM one.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .gguf_file import GGUFFile
from .kernels import Weight

PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertSlice:
    name: str
    qtype: object
    shape: tuple          # one expert: (n_out, n_in)
    offset: int           # of expert 0 in the file
    nbytes: int           # per expert

    def range(self, e: int) -> tuple[int, int]:
        return self.offset + e * self.nbytes, self.nbytes


def expert_map(g: GGUFFile) -> dict[tuple[int, str], ExpertSlice]:
    """(layer, projection) -> where its experts are in the file."""
    out = {}
    for name, t in g.tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2].endswith("_exps"):
            proj = parts[2][len("ffn_"):-len("_exps")]
            n_expert = t.shape[0]
            out[(int(parts[1]), proj)] = ExpertSlice(name, t.type, t.shape[1:], t.offset, t.n_bytes // n_expert)
    return out


class ExpertStore:
    def __init__(self, path, direct: bool = True):
        self.path = str(path)
        self.io_mode = "buffered"
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                self.io_mode = "direct"
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY)
        self.align = max(512, os.fstat(self.fd).st_blksize)
        self.fallback_reason: str | None = None if self.io_mode == "direct" else "O_DIRECT refused at open"

    def span(self, offset: int, length: int) -> tuple[int, int]:
        """The aligned superset [start, start+size) of a byte range."""
        start = offset // self.align * self.align
        end = -(-(offset + length) // self.align) * self.align
        return start, end - start

    def read_into(self, dest: memoryview, offset: int, length: int) -> memoryview:
        """Read file bytes [offset, offset+length) into the page-aligned `dest`; return the view
        of exactly those bytes inside it."""
        start, size = self.span(offset, length)
        if size > len(dest):
            raise ValueError(f"slot of {len(dest)} bytes is smaller than the aligned read of {size}")
        try:
            got = os.preadv(self.fd, [dest[:size]], start)
        except OSError as e:
            if e.errno != errno.EINVAL or self.io_mode != "direct":
                raise
            self._to_buffered("O_DIRECT refused at read (EINVAL)")
            got = os.preadv(self.fd, [dest[:size]], start)
        if got < offset - start + length:
            raise OSError(errno.EIO, f"short read of {self.path}: {got} bytes at {start}, needed {offset - start + length}")
        if self.io_mode == "buffered" and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, start, size, os.POSIX_FADV_DONTNEED)
        return dest[offset - start: offset - start + length]

    def _to_buffered(self, reason: str) -> None:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.io_mode, self.fallback_reason = "buffered", reason

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ExpertCache:
    """LRU cache of experts in fixed, page-aligned slots; each slot holds gate, up and down."""

    def __init__(self, g: GGUFFile, store: ExpertStore, slots: int, threads: int = 4):
        self.map = expert_map(g)
        if not self.map:
            raise ValueError(f"{g.path} has no expert tensors to stream")
        self.store = store
        self.n_expert = next(iter(g.tensors[s.name] for s in self.map.values())).shape[0]
        page = mmap.PAGESIZE
        # the aligned span of any slice is at most ceil(n / align) + 1 alignment units
        self.part_bytes = {p: max((-(-s.nbytes // store.align) + 1) * store.align
                                  for (_, pp), s in self.map.items() if pp == p) for p in PROJECTIONS}
        self.part_bytes = {p: -(-b // page) * page for p, b in self.part_bytes.items()}
        self.slot_bytes = sum(self.part_bytes.values())
        self.slots = max(1, slots)
        self.buffer = mmap.mmap(-1, self.slots * self.slot_bytes)        # page-aligned
        self.index: OrderedDict[tuple[int, int], int] = OrderedDict()      # (layer, expert) -> slot
        self.views: dict[int, dict[str, Weight]] = {}
        self.free = list(range(self.slots))
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=threads)
        self.hits = self.misses = self.bytes_read = 0
        self.read_seconds = 0.0

    def _load(self, layer: int, e: int, slot: int) -> dict[str, Weight]:
        mv = memoryview(self.buffer)
        base = slot * self.slot_bytes
        out = {}
        for p in PROJECTIONS:
            s = self.map[(layer, p)]
            off, n = s.range(e)
            view = self.store.read_into(mv[base: base + self.part_bytes[p]], off, n)
            base += self.part_bytes[p]
            raw = np.frombuffer(view, dtype=np.uint8).reshape(s.shape[0], n // s.shape[0])
            out[p] = Weight(f"{s.name}[{e}]", s.qtype, s.shape, raw)
            self.bytes_read += self.store.span(off, n)[1]
        return out

    def prefetch(self, layer: int, experts) -> None:
        """Make `experts` of `layer` resident, reading the misses in parallel."""
        todo = []
        with self.lock:
            for e in experts:
                key = (layer, int(e))
                if key in self.index:
                    self.hits += 1
                    self.index.move_to_end(key)
                    continue
                self.misses += 1
                if self.free:
                    slot = self.free.pop()
                else:
                    old, slot = self.index.popitem(last=False)
                    self.views.pop(slot, None)
                self.index[key] = slot
                todo.append((key, slot))
                if len(todo) >= self.slots:
                    break
        t0 = time.perf_counter()
        for (key, slot), views in zip(todo, self.pool.map(lambda ks: self._load(ks[0][0], ks[0][1], ks[1]), todo)):
            self.views[slot] = views
        self.read_seconds += time.perf_counter() - t0

    def weights(self, layer: int, e: int) -> tuple[Weight, Weight, Weight]:
        key = (layer, int(e))
        if key not in self.index:
            self.prefetch(layer, [e])
        else:
            self.index.move_to_end(key)
        v = self.views[self.index[key]]
        return v["gate"], v["up"], v["down"]

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"io_mode": self.store.io_mode, "fallback_reason": self.store.fallback_reason,
                "slots": self.slots, "used": len(self.index), "slot_bytes": self.slot_bytes,
                "cache_bytes": self.slots * self.slot_bytes, "hits": self.hits, "misses": self.misses,
                "hit_rate": round(self.hits / total, 4) if total else None, "bytes_read": self.bytes_read,
                "read_gb_s": round(self.bytes_read / self.read_seconds / 1e9, 3) if self.read_seconds else None}
