"""Where the expert cache's slots live: in huge pages when the system allows it.

Experts are read with O_DIRECT straight into the slots, and the pages they land in decide how
fast the disk goes. Measured here (reads of 2 MiB at random offsets, four in flight): into 4 KiB
pages 1.08–1.19 GB/s at 65–82 ms of kernel CPU per GB; into 2 MiB pages 1.78–2.02 GB/s at
34–37 ms/GB — a request carries one physically contiguous segment instead of 512, and pinning
is per huge page. The streamed 25 % decode of bench/moe_stream.py went from 0.49–0.61 to
0.58–0.76 of in-RAM speed in the same runs.

The supervisor's segment (a file in /dev/shm) outlives a worker that crashes, so the restarted
worker starts warm; but it is shmem, which takes huge pages only where the system enables them
for it (the tmpfs mount's `huge=` option, or shmem_enabled `force`). Private anonymous memory
takes them wherever transparent huge pages are `always` or `madvise` (most distributions). So:

- `shared`: the segment — warm restarts — with huge pages if shmem has them;
- `private`: the worker's own memory with huge pages — a restarted worker starts cold;
- `auto` (default): the segment if it can have huge pages, else private memory if that can,
  else the segment. The worker's status says which, and why.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

MODES = ("auto", "shared", "private")
THP = Path("/sys/kernel/mm/transparent_hugepage")


@dataclass(frozen=True)
class Placement:
    kind: str                  # "shared" | "private"
    huge_pages: bool           # whether the system lets this memory have huge pages
    why: str

    @property
    def warm_restart(self) -> bool:
        return self.kind == "shared"


def _selected(path: Path) -> str | None:
    """The bracketed choice of a sysfs setting ("always [madvise] never" -> "madvise")."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def anon_huge_pages(thp: Path = THP) -> bool:
    return _selected(thp / "enabled") in ("always", "madvise")


def shmem_huge_pages(segment: str, thp: Path = THP, mounts: Path = Path("/proc/mounts")) -> bool:
    """Whether a file at `segment` (on tmpfs) can be backed by huge pages."""
    if _selected(thp / "shmem_enabled") == "force":
        return True
    if _selected(thp / "shmem_enabled") == "deny":
        return False
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return False
    best, opts = "", ""
    for line in lines:                                   # the mount the segment is on: longest prefix
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "tmpfs" and (segment + "/").startswith(parts[1].rstrip("/") + "/") \
                and len(parts[1]) > len(best):
            best, opts = parts[1], parts[3]
    return any(o in ("huge=always", "huge=within_size", "huge=advise") for o in opts.split(","))


def place(mode: str, segment: str | None, thp: Path = THP, mounts: Path = Path("/proc/mounts")) -> Placement:
    if mode not in MODES:
        raise ValueError(f"cache_memory {mode!r} is not one of {', '.join(MODES)}")
    shared_huge = segment is not None and shmem_huge_pages(segment, thp, mounts)
    private_huge = anon_huge_pages(thp)
    if mode == "shared" or (mode == "auto" and segment is not None and (shared_huge or not private_huge)):
        if segment is None:
            raise ValueError("cache_memory = shared needs the supervisor's segment (start the worker with `kiln up`)")
        why = ("the supervisor's segment, in huge pages: warm restarts and full-speed reads" if shared_huge else
               "the supervisor's segment (warm restarts); shared memory takes no huge pages here, so reads "
               "are slower" + ("" if mode == "shared" else " — and neither does private memory"))
        return Placement("shared", shared_huge, why)
    why = ("private memory in huge pages: the disk reads about 1.5x faster into them"
           + ("" if mode == "private" else "; shared memory takes no huge pages here (the /dev/shm mount "
              "has no huge= option), so a restarted worker starts with a cold cache"))
    if not private_huge:
        why = "private memory; transparent huge pages are off, so reads use 4 KiB pages"
    return Placement("private", private_huge, why)


def private_buffer(size: int, huge: bool = True) -> mmap.mmap:
    """Anonymous private memory for the slots, asking for huge pages."""
    return _ask_huge(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), huge)


def shared_buffer(path: str, huge: bool) -> mmap.mmap:
    """The supervisor's segment, asking for huge pages where its mount gives them."""
    fd = os.open(path, os.O_RDWR)
    try:
        return _ask_huge(mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED), huge)
    finally:
        os.close(fd)


def _ask_huge(buf: mmap.mmap, huge: bool) -> mmap.mmap:
    """madvise(MADV_HUGEPAGE) — no error where the system gives none: the pages are then 4 KiB."""
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


def huge_page_bytes(address: int) -> int | None:
    """Bytes in huge pages now of the mapping that holds `address` (the cache's slots), from
    /proc/self/smaps — not the process's total: numpy asks for huge pages for its large arrays
    too. None where there is no such file."""
    try:
        with open("/proc/self/smaps") as f:
            inside, total = False, 0
            for line in f:
                head = line.split(maxsplit=1)[0]
                if head[0] in "0123456789abcdef" and "-" in head and not head.endswith(":"):
                    if inside:
                        break                             # the next mapping: done
                    lo, hi = (int(v, 16) for v in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                    total += int(line.split()[1]) * 1024
            return total
    except OSError:
        return None
