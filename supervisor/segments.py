"""Shared-memory segments the supervisor owns for its workers (the MoE expert caches).

A segment is a file in /dev/shm named `kiln-<uid>-<home hash>-<worker>`, mode 0600, so it
outlives a worker that crashes. `kiln up` removes every segment of its KILN_HOME left by a
killed daemon (it holds the single-instance lock, so none of them is in use) and `kiln down`
removes the ones it made."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, total_ram: int) -> int:
    """'512MiB', '2GB', '25%' (of RAM) -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"expert cache size {text!r} is not a size: use e.g. 512MiB, 2GiB or 25%")
    value, unit = float(m.group(1)), (m.group(2) or "").lower() or None
    if unit == "%":
        if not 0 < value <= 90:
            raise ValueError(f"expert cache {text!r}: a share of RAM must be in (0, 90]%")
        return int(total_ram * value / 100)
    return int(value * _UNITS[unit])


def prefix(home: Path) -> str:
    return f"kiln-{os.getuid()}-{hashlib.sha256(str(home).encode()).hexdigest()[:10]}-"


def remove_stale(home: Path) -> list[str]:
    removed = []
    if SHM_DIR.is_dir():
        for p in SHM_DIR.glob(prefix(home) + "*"):
            try:
                p.unlink()
                removed.append(p.name)
            except OSError:
                pass
    return removed


def create(home: Path, worker: str, size: int) -> Path:
    path = SHM_DIR / (prefix(home) + worker)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return path
