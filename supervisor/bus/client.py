"""Talking to a running daemon over its control socket (what the CLI and tests use)."""

from __future__ import annotations

import os

from kiln.protocol.client import BusClient, CommandFailed  # noqa: F401  (CommandFailed: for callers)

from ..core.run_files import read_pid
from ..core.paths import Paths


class DaemonNotRunning(RuntimeError):
    pass


def daemon_pid(paths: Paths) -> int | None:
    pid = read_pid(paths)
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


class ControlClient(BusClient):
    def __init__(self, paths: Paths | None = None, timeout: float = 15.0):
        self.paths = paths or Paths.from_env()
        self.pid = daemon_pid(self.paths)
        if self.pid is None or not self.paths.keyfile.exists():
            raise DaemonNotRunning(f"kiln is not running (no daemon for KILN_HOME={self.paths.home}); "
                                   f"start it with `kiln up`")
        try:
            key = self.paths.keyfile.read_bytes()
        except PermissionError:
            raise DaemonNotRunning(f"cannot read {self.paths.keyfile}: the daemon belongs to another user") from None
        super().__init__(self.paths.control_endpoint, key, timeout, f"the daemon (pid {self.pid})")
