"""How many compute threads to run while other processes use the cores.

OpenMP threads meet at a barrier several hundred times per decoded token; when another process
holds one of the cores, the thread that shares it arrives late at every barrier and the whole
step waits (measured on 2 cores with a CPU-bound process beside it: 2 threads 23 tok/s, 1
thread 37-41, alone 75). So the engine watches how much CPU the rest of the machine takes —
the busy time in /proc/stat (steal included: a hypervisor taking the core is the same) minus
this process's own — and computes on the cores that are left: fewer threads while others are
busy, all of them again once they stop. Linux only; elsewhere the count stays fixed.
"""

from __future__ import annotations

import os
import time

INTERVAL = 0.5          # seconds between looks at /proc/stat
STALE = 2.0             # a look older than this (the engine was idle) is not compared with
BUSY_BELOW = 0.5        # a core is ours while others use less than half of it
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy() -> float | None:
    """CPU-seconds the whole machine has spent busy (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    if not parts or parts[0] != "cpu":
        return None
    v = [int(x) for x in parts[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / TICK


def _own_busy() -> float:
    t = os.times()
    return t.user + t.system


def own_busy_of(model):
    """The CPU time that counts as this engine's own: this process's, and a split model's later
    stages on this machine (native/stages.py) — they work while this one waits for them, and are
    not other processes competing for the cores (counted so, the first stage ran on one thread:
    0.69x of the whole model instead of 0.9x)."""
    remote = getattr(model, "remote", None)
    return (lambda: _own_busy() + remote.cpu_here) if remote is not None else _own_busy


class CoreShare:
    """Call threads() between steps: the thread count for the next step, re-decided at most
    every INTERVAL seconds from what other processes used since the last look."""

    def __init__(self, max_threads: int, cores: int | None = None, clock=time.monotonic,
                 machine=_machine_busy, own=_own_busy):
        self.max_threads = max(1, max_threads)
        self.cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        self.clock, self.machine, self.own = clock, machine, own
        self.current = self.max_threads
        self.others = 0.0                         # cores the rest of the machine used, last interval
        self._last = None

    def resume(self) -> None:
        """The engine was idle: what other processes did meanwhile was not contention (they may
        use the cores we left), so start again with every thread and look after INTERVAL."""
        self._last, self.current = None, self.max_threads

    def threads(self) -> int:
        now = self.clock()
        if self._last is not None and now - self._last[0] < INTERVAL:
            return self.current
        busy, own = self.machine(), self.own()
        if busy is None:
            return self.current
        if self._last is not None and now - self._last[0] > STALE:
            self.resume()            # no step for a while: as after idling
        if self._last is not None:
            t0, b0, o0 = self._last
            wall = now - t0
            self.others = max(0.0, ((busy - b0) - (own - o0)) / wall)
            free = self.cores - int(self.others + (1 - BUSY_BELOW))     # a core others use half of is theirs
            self.current = max(1, min(self.max_threads, free))
        self._last = (now, busy, own)
        return self.current
