"""Where an expert lies in the cache's buffer, and the index that lets a restarted worker find
it again (a part of ExpertCache, native/experts/cache.py).

A slot holds one expert's gate, up and down, each projection's part page-aligned and large
enough for any aligned read of it. With a shared-memory segment the buffer starts with an index —
a header (magic, model identity, slot size and count) and an entry per slot (ready, layer,
expert, CRC32 of samples, use sequence) — written only after a slot's read completes, so a
worker restarted after a crash re-attaches, re-checks each ready slot and starts warm.
"""

from __future__ import annotations

import mmap
import struct
import zlib

import numpy as np

from ..gguf_file import GGUFFile
from ..kernels import Weight
from .store import PROJECTIONS, ExpertStore, expert_map

_MAGIC = b"KILNEXP1"
_HEADER = struct.Struct("<8sQQQQ")            # magic, model identity, slot_bytes, slots, reserved
_ENTRY = np.dtype([("state", "<u4"), ("layer", "<i4"), ("expert", "<i4"), ("crc", "<u4"), ("seq", "<u8")])
READY = 1
ENTRY_BYTES = _ENTRY.itemsize


class Slots:
    """The slots' geometry and their index in the buffer (mixed into ExpertCache)."""

    @staticmethod
    def index_bytes(slots: int) -> int:
        return -(-(_HEADER.size + slots * _ENTRY.itemsize) // mmap.PAGESIZE) * mmap.PAGESIZE

    def _geometry(self, g: GGUFFile, store: ExpertStore) -> None:
        if max(1, len(g.parts)) != len(store.paths):
            raise ValueError(f"{g.path} is a model split in {len(g.parts)} files but the expert store reads "
                             f"{len(store.paths)}; open the store with the model's parts")
        self.map = expert_map(g)
        if not self.map:
            raise ValueError(f"{g.path} has no expert tensors to stream: it is not a mixture-of-experts "
                             f"model; serve it without streaming (kind = \"inference\", or no --stream)")
        page = mmap.PAGESIZE
        # the aligned span of any slice is at most ceil(n / align) + 1 alignment units
        self.part_bytes = {p: max((-(-s.nbytes // store.align) + 1) * store.align
                                  for (_, pp), s in self.map.items() if pp == p) for p in PROJECTIONS}
        self.part_bytes = {p: -(-b // page) * page for p, b in self.part_bytes.items()}
        self.slot_bytes = sum(self.part_bytes.values())
        self.n_expert = next(iter(g.tensors[s.name] for s in self.map.values())).shape[0]
        self.expert_count = len({layer for layer, _ in self.map}) * self.n_expert

    def _open_index(self, g: GGUFFile, buffer) -> None:
        """The index at the buffer's start: an entry per slot, and whose model they are."""
        self.entries = np.frombuffer(buffer, _ENTRY, self.slots, _HEADER.size)
        self.entry_seq = self.entries["seq"]                               # a view: one store per use
        self.identity = zlib.crc32(f"{g.path.name}|{g.file_size}|{g.data_offset}".encode())

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
                    self._fingerprint(i) != int(ent["crc"]):
                self.entries[i]["state"] = 0                   # torn or foreign: forget it
                continue
            valid.append((int(ent["seq"]), layer, e, i))
        for seq, layer, e, i in sorted(valid):                 # oldest first: the policy's order
            self.index[(layer, e)] = i
            self.views[i] = self._ready(layer, e, i)
            self._placed((layer, e), self.views[i])
            self.policy.touch((layer, e))
            self.seq = max(self.seq, seq)
        return len(valid)

    SAMPLE = 512

    def _fingerprint(self, slot: int) -> int:
        """CRC32 of a slot's first, middle and last 512 bytes of each projection. A slot is only
        marked ready after its read completes (the state word is cleared first), so the check
        on re-attach is against a foreign or stale segment, not torn writes; sampling keeps it
        off the decode path's CPU budget (a whole-slot CRC32 cost ~14 ms per token at 25 %,
        4 KiB samples ~25 µs per read)."""
        crc, base = 0, slot * self.slot_bytes
        for p in PROJECTIONS:
            n = self.part_bytes[p]
            for off in (0, n // 2 // self.SAMPLE * self.SAMPLE, n - self.SAMPLE):
                crc = zlib.crc32(self.data[base + off: base + off + self.SAMPLE], crc)
            base += n
        return crc

    def _layout(self, layer: int, e: int, slot: int) -> list[tuple]:
        """Per projection of expert e in `slot`: (projection, file offset, bytes, where its part
        of the slot starts in `data`). The aligned read lands at the part's start, so the
        projection's bytes begin `offset % align` into it."""
        out, base = [], slot * self.slot_bytes
        for p in PROJECTIONS:
            off, n = self.map[(layer, p)].range(e)
            out.append((p, off, n, base))
            base += self.part_bytes[p]
        return out

    def _ready(self, layer: int, e: int, slot: int) -> dict:
        """A slot just read: where its projections start (for the address table). Its views —
        what the Python path multiplies — are made when first asked for (`_weights_at`); the
        compiled decode needs only the addresses."""
        align = self.store.align
        self.addresses[slot] = [self.data_address + base + off % align for _, off, _, base in self._layout(layer, e, slot)]
        return {}

    def _views(self, layer: int, e: int, slot: int) -> dict[str, Weight]:
        out = {}
        for p, off, n, base in self._layout(layer, e, slot):
            s = self.map[(layer, p)]
            start = base + off % self.store.align
            out[p] = Weight(f"{s.name}[{e}]", s.qtype, s.shape,
                            np.frombuffer(self.data[start: start + n], dtype=np.uint8).reshape(s.shape[0], n // s.shape[0]))
        return out
