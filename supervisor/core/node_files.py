"""Model files on a cluster's nodes: the server on the supervisor's node that hands out the files
the supervisor allows, in bounded chunks, with their sha256; and the fetch a node's actor runs
before it starts a worker whose model is not on its disk — checked against that sha256 before a
byte of it is used.

Plain Python, no Ray or Kiln imports (ray_spawner.py wraps FileServer with `ray.remote`; the
node side runs inside node_host.py's actor).
"""

from __future__ import annotations

import fcntl
import hashlib
import os

CHUNK = 16 * 2**20            # bytes per read: a 5 GB model in ~300 calls, 16 MiB in flight


class FileServer:
    """Serves the files the supervisor allowed (by absolute path) — nothing else."""

    def __init__(self):
        self.allowed: dict[str, int] = {}          # path -> size when allowed
        self.digests: dict[tuple, str] = {}

    def allow(self, path: str) -> int:
        size = os.path.getsize(path)
        self.allowed[path] = size
        return size

    def _check(self, path: str) -> int:
        if path not in self.allowed:
            raise PermissionError(f"{path} is not a file this supervisor hands out")
        return self.allowed[path]

    def digest(self, path: str) -> str:
        """The file's sha256 (hashed once per size and modification time)."""
        self._check(path)
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in self.digests:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(CHUNK), b""):
                    h.update(block)
            self.digests[key] = h.hexdigest()
        return self.digests[key]

    def read(self, path: str, offset: int, n: int) -> bytes:
        size = self._check(path)
        if not (isinstance(offset, int) and isinstance(n, int) and 0 <= offset <= size and 0 < n <= CHUNK):
            raise ValueError(f"read {offset}+{n} of {path}: outside the file or larger than {CHUNK} bytes")
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(n)


class FetchError(OSError):
    """A model file could not be brought to this node intact (the message says why)."""


def local_copy(store: str, node: str, name: str, sha256: str) -> str:
    """Where this node keeps its copy of a file: by node and content, so two nodes sharing a
    folder never share a half-written copy, and a new version never takes an old one's place."""
    return os.path.join(store, node[:12], f"{sha256[:16]}-{os.path.basename(name)}")


def fetch(read, size: int, sha256: str, target: str, log=lambda line: None) -> int:
    """Bring a file of `size` bytes to `target` with `read(offset, n) -> bytes`, its sha256
    checked before it takes its name (a copy that does not match is removed). Returns the bytes
    fetched (0: a checked copy was already there). Two workers starting on one node fetch once:
    the second waits on the first's lock, then finds its checked copy."""
    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
    with open(target + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch(read, size, sha256, target, log)


def _fetch(read, size: int, sha256: str, target: str, log) -> int:
    done = target + ".sha256"
    if os.path.isfile(target) and os.path.getsize(target) == size and os.path.isfile(done) \
            and open(done).read().strip() == sha256:
        return 0
    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
    part = f"{target}.part-{os.getpid()}"
    h, at, step = hashlib.sha256(), 0, max(1, size // 10)
    try:
        with open(part, "wb") as f:
            while at < size:
                block = read(at, min(CHUNK, size - at))
                if not block:
                    raise FetchError(f"the source of {os.path.basename(target)} ended at {at} of {size} bytes")
                f.write(block)
                h.update(block)
                if (at + len(block)) // step != at // step:
                    log(f"fetched {at + len(block)} of {size} bytes of {os.path.basename(target)}")
                at += len(block)
        if at != size or h.hexdigest() != sha256:
            raise FetchError(f"the copy of {os.path.basename(target)} does not match its sha256 "
                             f"({h.hexdigest()[:16]}… ≠ {sha256[:16]}…): refused")
        os.replace(part, target)
        with open(done, "w") as f:
            f.write(sha256 + "\n")
        return size
    finally:
        if os.path.exists(part):
            os.unlink(part)
