"""Worker processes as the supervisor sees them: spawn, signal, reap, measure.

Mechanism only: *when* to do any of this is supervisor/policy.py's decision.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

from .config import BUILTIN_KINDS
from .paths import Paths
from .policy import ProcState


@dataclass
class WorkerProcess:
    name: str
    spec: dict                                   # the [workers.<name>] table, validated
    ps: ProcState = field(default_factory=ProcState)
    proc: subprocess.Popen | None = None
    identity: bytes | None = None                # ROUTER identity after hello: b"name:pid"
    hello: dict | None = None                    # kind, ops, protocol
    last_heartbeat: float = 0.0                  # monotonic
    status: dict = field(default_factory=dict)   # the last heartbeat's body (state, stats)
    started_wall: float | None = None
    kill_at: float | None = None                 # SIGKILL deadline after a SIGTERM
    boot_reason: str | None = None               # from an `error boot_failed` message
    _psutil: psutil.Process | None = None

    @property
    def kind(self) -> str:
        return self.spec["kind"]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.returncode is None else None

    def spawn(self, paths: Paths, endpoint: str, heartbeat_interval: float) -> None:
        module = self.spec.get("module") or BUILTIN_KINDS[self.kind]
        settings = {"model": self.spec.get("model"), "threads": self.spec.get("threads"),
                    **self.spec.get("settings", {})}
        env = dict(os.environ, KILN_WORKER_NAME=self.name, KILN_ENDPOINT=endpoint,
                   KILN_KEY_FILE=str(paths.keyfile), KILN_WORKER_SETTINGS=json.dumps(settings),
                   KILN_HEARTBEAT_INTERVAL=str(heartbeat_interval), KILN_STATE_DIR=str(paths.home),
                   KILN_CONTROL_ENDPOINT=paths.control_endpoint,
                   PYTHONUNBUFFERED="1")
        log = open(paths.worker_log(self.name), "ab", buffering=0)
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} kiln: starting {self.kind} worker "
                  f"{self.name} ({module})\n".encode())
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=env,
                                         close_fds=True)
        finally:
            log.close()
        self.identity, self.hello, self.status, self.boot_reason = None, None, {}, None
        self.last_heartbeat = time.monotonic()
        self.started_wall = time.time()
        self.kill_at = None
        self._psutil = None

    def terminate(self, graceful_timeout: float) -> None:
        """SIGTERM (and SIGCONT, so a stopped process can act on it); SIGKILL later."""
        if self.pid:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass
            self.kill_at = time.monotonic() + graceful_timeout

    def kill(self) -> None:
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self) -> tuple[int | None, int | None] | None:
        """(exit code, signal) if the process has ended since the last call, else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        rc = self.proc.returncode
        self.proc = None
        self.identity = None
        self.kill_at = None
        return (rc, None) if rc >= 0 else (None, -rc)

    def last_log_line(self, paths: Paths) -> str | None:
        try:
            with open(paths.worker_log(self.name), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines()
                         if ln.strip() and not ln.startswith("--- ")]
            return lines[-1].strip() if lines else None
        except OSError:
            return None

    def describe(self, now_wall: float) -> dict:
        rss, cpu = None, None
        if self.pid:
            try:
                if self._psutil is None or self._psutil.pid != self.pid:
                    self._psutil = psutil.Process(self.pid)
                    self._psutil.cpu_percent(None)
                rss = self._psutil.memory_info().rss
                cpu = self._psutil.cpu_percent(None)
            except psutil.Error:
                pass
        ps = self.ps
        up = now_wall - self.started_wall if self.pid and self.started_wall else None
        return {
            "name": self.name, "kind": self.kind, "state": ps.state, "pid": self.pid,
            "uptime_s": round(up, 3) if up is not None else None,
            "restarts": ps.restarts, "last_exit": ps.last_exit, "reason": ps.reason,
            "rss_bytes": rss, "cpu_percent": cpu,
            "worker_state": self.status.get("state"),
            "stats": {k: v for k, v in self.status.items() if k != "state"},
            "ops": (self.hello or {}).get("ops", []),
            "model": self.spec.get("model") if self.kind != "test" else None,
            "log": None,
        }
