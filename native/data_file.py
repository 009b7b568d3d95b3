"""Reading a data file someone named (training JSONL, an eval suite): a regular file only, at most
`limit` bytes, read in bounded pieces — `/dev/zero`, a FIFO or a file that grows while it is read
is an error at once, never a process that swells until the kernel kills it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_DATA_BYTES = 1 << 30        # no training or eval file Kiln reads is larger (the trainer holds it whole)


class DataFileError(ValueError):
    """The file cannot be used as data; the message names it and says why."""


def read_data_file(path: str | Path, limit: int = MAX_DATA_BYTES) -> bytes:
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)     # a FIFO must not block the open
    except OSError as e:
        raise DataFileError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataFileError(f"{path}: not a regular file (a device, pipe or folder cannot be data)")
        if st.st_size > limit:
            raise DataFileError(f"{path}: {st.st_size} bytes, over the {limit}-byte limit for a data file; split it")
        parts, got = [], 0
        while piece := os.read(fd, min(1 << 20, limit + 1 - got)):
            parts.append(piece)
            got += len(piece)
            if got > limit:
                raise DataFileError(f"{path}: grew past the {limit}-byte limit while it was read")
        return b"".join(parts)
    finally:
        os.close(fd)
