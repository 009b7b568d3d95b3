"""Streaming MoE experts from disk: where each expert lives, how it is read, where it is kept.

- `expert_map`: from the GGUF tensor table, the file byte range of every (layer, expert,
  projection) slice of `ffn_{gate,up,down}_exps` — the expert is the outermost dimension, so each
  slice is contiguous; starts are only 32-byte aligned.
- `ExpertStore`: reads slices with `O_DIRECT` — the aligned superset of the range, into
  page-aligned memory, with `os.preadv` — so streamed experts do not fill the page cache. Where
  O_DIRECT is refused (EINVAL at open or read: tmpfs, overlayfs) it falls back to buffered
  `preadv` + `posix_fadvise(DONTNEED)` and says so in `io_mode`; never silently.
- `ExpertCache`: a fixed number of slots (one expert's three projections each) in one page-aligned
  buffer, LRU eviction (or LFU with aging, `policy="lfu"`: bench/moe_stream.py compares them),
  hit/miss/byte/time counters, I/O time and bytes per token. `weights(layer, expert)` returns `Weight`s
  whose blocks are views of the slot: the kernels multiply them in place, so a streamed forward
  pass computes the same bits as the in-RAM one.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
import time
import zlib
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
        if len(parts) == 4 and parts[0] == "blk" and parts[2].endswith("_exps") and parts[3] == "weight":
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
        self._switch = threading.Lock()
        self._retired: list[int] = []       # the O_DIRECT fd after a fallback: other reads may still use it

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
        fd = self.fd
        try:
            got = os.preadv(fd, [dest[:size]], start)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._to_buffered(fd, "O_DIRECT refused at read (EINVAL)")
            got = os.preadv(self.fd, [dest[:size]], start)
        if got < offset - start + length:
            raise OSError(errno.EIO, f"short read of {self.path}: {got} bytes at {start}, needed {offset - start + length}")
        if self.io_mode == "buffered" and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, start, size, os.POSIX_FADV_DONTNEED)
        return dest[offset - start: offset - start + length]

    def _to_buffered(self, failed_fd: int, reason: str) -> None:
        with self._switch:                  # parallel reads may all hit EINVAL: switch once
            if self.fd != failed_fd:
                return
            self._retired.append(self.fd)
            self.fd = os.open(self.path, os.O_RDONLY)
            self.io_mode, self.fallback_reason = "buffered", reason

    def close(self) -> None:
        for fd in self._retired + ([self.fd] if self.fd >= 0 else []):
            os.close(fd)
        self._retired, self.fd = [], -1


_MAGIC = b"KILNEXP1"
_HEADER = struct.Struct("<8sQQQQ")            # magic, model identity, slot_bytes, slots, reserved
_ENTRY = np.dtype([("state", "<u4"), ("layer", "<i4"), ("expert", "<i4"), ("crc", "<u4"), ("seq", "<u8")])
READY = 1


def segment_bytes(g: GGUFFile, store: ExpertStore, budget: int) -> tuple[int, int]:
    """(slots, total bytes) of a cache segment that fits in `budget` bytes."""
    probe = ExpertCache.__new__(ExpertCache)
    probe._geometry(g, store)
    per_slot = probe.slot_bytes + _ENTRY.itemsize
    slots = max(1, (budget - 4096) // per_slot)
    return int(slots), int(ExpertCache.index_bytes(slots) + slots * probe.slot_bytes)


class ExpertCache:
    """LRU cache of experts in fixed, page-aligned slots; each slot holds gate, up and down.

    With `buffer` (a shared-memory segment the supervisor owns) the cache keeps an index at the
    start of it: a slot is marked ready, with its (layer, expert), LRU sequence and CRC32, only
    after its read completes. A restarted worker re-attaches, re-checks every ready slot's CRC32
    and starts warm; a segment made for another model or geometry is reset."""

    @staticmethod
    def index_bytes(slots: int) -> int:
        return -(-(_HEADER.size + slots * _ENTRY.itemsize) // mmap.PAGESIZE) * mmap.PAGESIZE

    def _geometry(self, g: GGUFFile, store: ExpertStore) -> None:
        self.map = expert_map(g)
        if not self.map:
            raise ValueError(f"{g.path} has no expert tensors to stream")
        page = mmap.PAGESIZE
        # the aligned span of any slice is at most ceil(n / align) + 1 alignment units
        self.part_bytes = {p: max((-(-s.nbytes // store.align) + 1) * store.align
                                  for (_, pp), s in self.map.items() if pp == p) for p in PROJECTIONS}
        self.part_bytes = {p: -(-b // page) * page for p, b in self.part_bytes.items()}
        self.slot_bytes = sum(self.part_bytes.values())

    POLICIES = ("lru", "lfu")

    def __init__(self, g: GGUFFile, store: ExpertStore, slots: int, threads: int = 4, buffer=None,
                 policy: str = "lru"):
        if policy not in self.POLICIES:
            raise ValueError(f"expert cache policy {policy!r} is not one of {', '.join(self.POLICIES)}")
        self.policy = policy
        self.freq: dict[tuple[int, int], float] = {}     # LFU: uses of each (layer, expert), aged
        self.tokens = 0                                   # rows routed through layer 0
        self._geometry(g, store)
        self.store = store
        self.n_expert = next(iter(g.tensors[s.name] for s in self.map.values())).shape[0]
        self.slots = max(1, slots)
        head = self.index_bytes(self.slots)
        if buffer is None:
            buffer = mmap.mmap(-1, head + self.slots * self.slot_bytes)    # page-aligned
        if len(buffer) < head + self.slots * self.slot_bytes:
            raise ValueError(f"cache buffer of {len(buffer)} bytes is too small for {self.slots} slots")
        self.buffer = buffer
        self.data = memoryview(buffer)[head:]                              # slots start page-aligned
        self.entries = np.frombuffer(buffer, _ENTRY, self.slots, _HEADER.size)
        self.identity = zlib.crc32(f"{g.path.name}|{g.file_size}|{g.data_offset}".encode())
        self.index: OrderedDict[tuple[int, int], int] = OrderedDict()      # (layer, expert) -> slot
        self.views: dict[int, dict[str, Weight]] = {}
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=threads)
        self.hits = self.misses = self.bytes_read = 0
        self.read_seconds = 0.0
        self.seq = 0
        self.warm_slots = self._attach()
        self.free = [i for i in range(self.slots) if i not in set(self.index.values())]

    def _attach(self) -> int:
        """Adopt the valid slots a previous worker left in the buffer; return how many."""
        magic, ident, slot_bytes, slots, _ = _HEADER.unpack_from(self.buffer, 0)
        if (magic, ident, slot_bytes, slots) != (_MAGIC, self.identity, self.slot_bytes, self.slots):
            self.entries[:] = 0
            _HEADER.pack_into(self.buffer, 0, _MAGIC, self.identity, self.slot_bytes, self.slots, 0)
            return 0
        valid = []
        for i, ent in enumerate(self.entries):
            if ent["state"] != READY:
                continue
            layer, e = int(ent["layer"]), int(ent["expert"])
            if (layer, "gate") not in self.map or not 0 <= e < self.n_expert or \
                    zlib.crc32(self.data[i * self.slot_bytes:(i + 1) * self.slot_bytes]) != int(ent["crc"]):
                self.entries[i]["state"] = 0                   # torn or foreign: forget it
                continue
            valid.append((int(ent["seq"]), layer, e, i))
        for seq, layer, e, i in sorted(valid):
            self.index[(layer, e)] = i
            self.views[i] = self._views(layer, e, i)
            self.seq = max(self.seq, seq)
        return len(valid)

    def _views(self, layer: int, e: int, slot: int) -> dict[str, Weight]:
        base, out = slot * self.slot_bytes, {}
        for p in PROJECTIONS:
            s = self.map[(layer, p)]
            off, n = s.range(e)
            start, _ = self.store.span(off, n)
            view = self.data[base + off - start: base + off - start + n]
            out[p] = Weight(f"{s.name}[{e}]", s.qtype, s.shape,
                            np.frombuffer(view, dtype=np.uint8).reshape(s.shape[0], n // s.shape[0]))
            base += self.part_bytes[p]
        return out

    def _load(self, layer: int, e: int, slot: int) -> dict[str, Weight]:
        self.entries[slot]["state"] = 0                      # not valid until fully read
        base = slot * self.slot_bytes
        for p in PROJECTIONS:
            s = self.map[(layer, p)]
            off, n = s.range(e)
            self.store.read_into(self.data[base: base + self.part_bytes[p]], off, n)
            base += self.part_bytes[p]
            self.bytes_read += self.store.span(off, n)[1]
        ent = self.entries[slot]
        ent["layer"], ent["expert"] = layer, e
        ent["crc"] = zlib.crc32(self.data[slot * self.slot_bytes:(slot + 1) * self.slot_bytes])
        ent["state"] = READY
        return self._views(layer, e, slot)

    def _victim(self) -> tuple[tuple[int, int], int]:
        """The slot to evict: least recently used, or (LFU) least used, oldest first on ties."""
        if self.policy == "lru":
            return self.index.popitem(last=False)
        key = min(self.index, key=lambda k: self.freq.get(k, 0.0))   # OrderedDict: LRU order breaks ties
        return key, self.index.pop(key)

    def prefetch(self, layer: int, experts, rows: int = 0) -> None:
        """Make `experts` of `layer` resident, reading the misses in parallel. `rows`: how many
        tokens this layer is routing (counted at layer 0, for per-token figures)."""
        todo = []
        with self.lock:
            if layer == 0:
                self.tokens += rows
                if self.policy == "lfu" and self.tokens % 256 < rows:     # age: old popularity fades
                    self.freq = {k: v / 2 for k, v in self.freq.items() if v >= 0.5}
            for e in experts:
                key = (layer, int(e))
                self.seq += 1
                if self.policy == "lfu":
                    self.freq[key] = self.freq.get(key, 0.0) + 1
                if key in self.index:
                    self.hits += 1
                    self.index.move_to_end(key)
                    self.entries[self.index[key]]["seq"] = self.seq
                    continue
                self.misses += 1
                if self.free:
                    slot = self.free.pop()
                else:
                    old, slot = self._victim()
                    self.views.pop(slot, None)
                self.index[key] = slot
                self.entries[slot]["seq"] = self.seq
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
                "slots": self.slots, "used": len(self.index), "warm_slots_at_start": self.warm_slots, "slot_bytes": self.slot_bytes,
                "cache_bytes": self.slots * self.slot_bytes, "hits": self.hits, "misses": self.misses,
                "hit_rate": round(self.hits / total, 4) if total else None, "bytes_read": self.bytes_read,
                "read_gb_s": round(self.bytes_read / self.read_seconds / 1e9, 3) if self.read_seconds else None,
                "policy": self.policy, "tokens": self.tokens,
                "io_ms_per_token": round(1000 * self.read_seconds / self.tokens, 3) if self.tokens else None,
                "bytes_read_per_token": round(self.bytes_read / self.tokens) if self.tokens else None}
