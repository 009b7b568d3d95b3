"""Starting real worker processes: the spawner the process table uses outside the fast tests.

Mechanism only: *when* to spawn, signal or give up is supervisor/policy.py's decision, and the
process table (supervisor/process_table.py) carries it out. A spawner returns a handle with
`pid`, `poll() -> None | returncode`, `send_signal(sig)`; tests use a fake one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from .config import BUILTIN_KINDS
from .paths import Paths


class ProcessSpawner:
    def __init__(self, paths: Paths, heartbeat_interval: float):
        self.paths, self.heartbeat_interval = paths, heartbeat_interval

    def spawn(self, name: str, spec: dict) -> subprocess.Popen:
        module = spec.get("module") or BUILTIN_KINDS[spec["kind"]]
        settings = {"model": spec.get("model"), "threads": spec.get("threads"), **spec.get("settings", {})}
        # A worker gets the worker socket and its own key — never the control socket or its key:
        # it reaches the supervisor only by sending requests up, which the router checks.
        env = {k: v for k, v in os.environ.items() if k not in ("KILN_CONTROL_ENDPOINT", "KILN_KEY_FILE")}
        # OpenMP threads that spin at barriers starve each other when two workers share the
        # cores: a stream fell to 1.5 s per token while a second model loaded and answered
        # (15 s for 8 tokens) with libgomp's default spin. A worker's scheduler now drops to
        # the cores other processes leave (native/core_share.py), so a spin of ~2 ms is safe
        # and keeps barriers fast when alone: 1000 (sleep almost at once) cost 10-20 % of
        # quiet decode (bench/throughput.py shared_cpu). A user's own setting wins.
        if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
            env["GOMP_SPINCOUNT"] = "30000"
        env.update(KILN_WORKER_NAME=name, KILN_ENDPOINT=self.paths.worker_endpoint,
                   KILN_WORKER_KEY_FILE=str(self.paths.worker_keyfile), KILN_WORKER_SETTINGS=json.dumps(settings),
                   KILN_HEARTBEAT_INTERVAL=str(self.heartbeat_interval), KILN_STATE_DIR=str(self.paths.home),
                   PYTHONUNBUFFERED="1")
        log = open(self.paths.worker_log(name), "ab", buffering=0)
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} kiln: starting {spec['kind']} worker "
                  f"{name} ({module})\n".encode())
        try:
            return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, env=env, close_fds=True)
        finally:
            log.close()

    def last_log_line(self, name: str) -> str | None:
        try:
            with open(self.paths.worker_log(name), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines()
                         if ln.strip() and not ln.startswith("--- ")]
            return lines[-1].strip() if lines else None
        except OSError:
            return None


def sample(pid: int, cache: dict) -> tuple[int | None, float | None]:
    """(rss bytes, cpu percent since the last sample) of a process; `cache` keeps psutil handles."""
    try:
        p = cache.get(pid)
        if p is None:
            cache.clear()
            p = cache[pid] = psutil.Process(pid)
            p.cpu_percent(None)
        return p.memory_info().rss, p.cpu_percent(None)
    except psutil.Error:
        return None, None
