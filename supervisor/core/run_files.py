"""The daemon's run files: the single-instance lock, the pidfile, the two HMAC keys and the ipc
socket paths — created private (0600 in a 0700 folder) and removed at shutdown."""

from __future__ import annotations

import fcntl
import os

from .paths import Paths


class AlreadyRunning(RuntimeError):
    def __init__(self, pid: int | None):
        super().__init__(f"kiln is already running (pid {pid})" if pid else "kiln is already running")
        self.pid = pid


def read_pid(paths: Paths) -> int | None:
    try:
        return int(paths.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _write_private(path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)


class RunFiles:
    def __init__(self, paths: Paths):
        self.paths = paths
        self.control_key = os.urandom(32)      # the CLI's key: only the user's shell reads it
        self.worker_key = os.urandom(32)       # the workers' key: signs the worker socket only
        self._lock_fd: int | None = None

    def acquire(self) -> None:
        """Take the single-instance lock, write the pidfile and keys, or raise AlreadyRunning."""
        self.paths.ensure()
        fd = os.open(self.paths.lockfile, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(read_pid(self.paths)) from None
        self._lock_fd = fd
        self.paths.pidfile.write_text(f"{os.getpid()}\n")
        _write_private(self.paths.keyfile, self.control_key)
        _write_private(self.paths.worker_keyfile, self.worker_key)

    def bind_path(self, endpoint: str) -> str:
        """The socket file of an ipc endpoint, a stale one (of a killed daemon) removed: we hold the lock."""
        path = endpoint[len("ipc://"):]
        if os.path.exists(path):
            os.unlink(path)
        return path

    def release(self, extra=()) -> None:
        for p in [self.paths.run / "workers.sock", self.paths.run / "control.sock", self.paths.keyfile,
                  self.paths.worker_keyfile, self.paths.pidfile, *extra]:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
