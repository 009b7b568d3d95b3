"""A model's tensors copied out of the file's page cache into private memory in huge pages.

By default a model's weights are views of the memory-mapped GGUF file: nothing is read until a
tensor is used, and every process that maps the file shares one copy, the page cache's. But the
page cache decides the pages: ext4 kept a file in 4 KiB pages until Linux 6.16 (Debian 12 and 13),
and a decode step that touches weights spread over gigabytes — a mixture of experts picks a few of
many — pays a TLB miss for each. A private copy asks for 2 MiB pages (`madvise(MADV_HUGEPAGE)`,
which transparent huge pages give where they are `always` or `madvise`). Measured on this VM
(bench/private_weights.py: one process, blocks of 16 decode tokens alternating between the mapped
and the private copy of the same model; medians of five runs), the private copy decodes the bench's
2.7 GB MoE 1.15× as fast with the page cache in 4 KiB pages, 1.10× with the file read whole, and
1.06–1.12× with the file mapped in 2 MiB pages (why, from inside the VM, I could not tell); a 100
MB model 1.01–1.05×. The price: the copy is the process's own — two processes of the same model
hold it twice — and it is read whole at load (at the disk's or the page cache's speed).

The copy reads through the page cache and then drops the pages it read (`POSIX_FADV_DONTNEED`: the
kernel keeps those another process maps), so the model is in memory once.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .experts.memory import huge_page_bytes, private_buffer

ALIGN = 4096                 # each tensor starts on a page of its own in the copy
CHUNK = 64 << 20             # bytes per read: the page cache drops each chunk as soon as it is copied


class PrivateWeights:
    """The named tensors of a GGUF file, copied into one private buffer: `arrays[name]` is the
    tensor's bytes (uint8), as GGUFFile.raw would give them from the mapping."""

    def __init__(self, g, names) -> None:
        infos = sorted((g.tensor(n) for n in set(names)), key=lambda t: (t.part, t.offset))
        places, at = [], 0
        for t in infos:
            places.append((t, at))
            at += -(-t.n_bytes // ALIGN) * ALIGN
        self.nbytes = sum(t.n_bytes for t in infos)
        t0 = time.perf_counter()
        self.buffer = private_buffer(max(at, ALIGN))
        self.address = np.frombuffer(self.buffer, np.uint8).ctypes.data
        view = memoryview(self.buffer)
        self.arrays: dict[str, np.ndarray] = {}
        fds: dict[int, int] = {}                 # a split model's parts: one descriptor each
        try:
            for t, dst in places:
                if t.part not in fds:
                    fds[t.part] = os.open(g.file_of(t), os.O_RDONLY)
                _read_exactly(fds[t.part], view[dst: dst + t.n_bytes], t.offset, g.file_of(t), t.name)
                arr = self.arrays[t.name] = np.frombuffer(self.buffer, np.uint8, t.n_bytes, dst)
                arr.flags.writeable = False      # as the read-only mapping's: a stray write raises
        finally:
            for fd in fds.values():
                os.close(fd)
        self.seconds = time.perf_counter() - t0

    def stats(self) -> dict:
        return {"bytes": self.nbytes, "tensors": len(self.arrays), "copy_seconds": round(self.seconds, 2),
                "huge_page_bytes": huge_page_bytes(self.address)}


def _read_exactly(fd: int, dest: memoryview, offset: int, path, name: str) -> None:
    done = 0
    while done < len(dest):
        n = min(CHUNK, len(dest) - done)
        got = os.preadv(fd, [dest[done: done + n]], offset + done)
        if got <= 0:
            raise OSError(f"{path}: tensor {name!r} ends early: {done + max(got, 0)} of {len(dest)} bytes "
                          f"at offset {offset} could be read (was the file truncated while loading?)")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset + done, got, os.POSIX_FADV_DONTNEED)
        done += got
