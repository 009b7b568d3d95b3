"""Streaming MoE experts from disk: where each expert lives and how it is read.

- `expert_map`: from the GGUF tensor table, the file byte range of every (layer, expert,
  projection) slice of `ffn_{gate,up,down}_exps` — the expert is the outermost dimension, so each
  slice is contiguous; starts are only 32-byte aligned.
  A split model's experts lie in several files: a slice's offset carries its part number above
  bit 44 (io.PART_SHIFT), which the reader turns back into a file and an offset in it.
- `ExpertStore`: the file (each part of a split model) opened for `O_DIRECT` reads — the aligned superset of a range, into
  page-aligned memory (native/experts/io.py reads) — so streamed experts do not fill the page
  cache. Where O_DIRECT is refused (EINVAL at open or read: tmpfs, overlayfs) it falls back to
  buffered reads + `posix_fadvise(DONTNEED)` and says so in `io_mode`; never silently.

Where read experts are kept is native/experts/cache.py.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass


from ..gguf_file import GGUFFile
from .io import PART_SHIFT

PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertSlice:
    name: str
    qtype: object
    shape: tuple          # one expert: (n_out, n_in)
    offset: int           # of expert 0 in its file
    nbytes: int           # per expert
    part: int = 0         # which file of a split model holds it

    def range(self, e: int) -> tuple[int, int]:
        """Where expert e is, as the reader takes it: (part << PART_SHIFT) + offset, bytes."""
        return (self.part << PART_SHIFT) + self.offset + e * self.nbytes, self.nbytes


def expert_map(g: GGUFFile) -> dict[tuple[int, str], ExpertSlice]:
    """(layer, projection) -> where its experts are in the file."""
    out = {}
    for name, t in g.tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2].endswith("_exps") and parts[3] == "weight":
            proj = parts[2][len("ffn_"):-len("_exps")]
            n_expert = t.shape[0]
            out[(int(parts[1]), proj)] = ExpertSlice(name, t.type, t.shape[1:], t.offset, t.n_bytes // n_expert, t.part)
    return out


class ExpertStore:
    def __init__(self, path, direct: bool = True, parts=()):
        """`parts`: a split model's files in order (GGUFFile.parts; the first is `path`)."""
        self.path = str(path)
        self.paths = [str(p) for p in parts] or [self.path]
        self.io_mode = "buffered"
        self.fds: list[int] = []
        if direct and hasattr(os, "O_DIRECT"):
            try:
                for p in self.paths:
                    self.fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
                self.io_mode = "direct"
            except OSError as e:
                self.close()
                if e.errno != errno.EINVAL:
                    raise
        if not self.fds:
            self.fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        self.align = max(512, *(os.fstat(fd).st_blksize for fd in self.fds))
        self.fallback_reason: str | None = None if self.io_mode == "direct" else "O_DIRECT refused at open"
        self._switch = threading.Lock()
        self._retired: list[int] = []       # the O_DIRECT fd after a fallback: other reads may still use it

    def span(self, offset: int, length: int) -> tuple[int, int]:
        """The aligned superset [start, start+size) of a byte range."""
        start = offset // self.align * self.align
        end = -(-(offset + length) // self.align) * self.align
        return start, end - start

    def to_buffered(self, reason: str) -> None:
        """From O_DIRECT to buffered reads (the reader calls this when O_DIRECT is refused at read)."""
        with self._switch:
            if self.io_mode == "buffered":
                return
            self._retired.extend(self.fds)
            self.fds = [os.open(p, os.O_RDONLY) for p in self.paths]
            self.io_mode, self.fallback_reason = "buffered", reason

    def close(self) -> None:
        for fd in getattr(self, "_retired", []) + self.fds:
            os.close(fd)
        self._retired, self.fds = [], []
