"""One row of the process table: a configured worker, its process (pid, peer identity), its
lifecycle state and what it last reported; and the clock the table reads (injected in tests)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kiln.protocol.vocab import serving

from . import policy


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


@dataclass
class WorkerProcess:
    name: str
    spec: dict                                   # the [workers.<name>] table, validated
    ps: policy.ProcState = field(default_factory=policy.ProcState)
    proc: Any = None                             # the spawner's handle (pid, poll, send_signal)
    identity: bytes | None = None                # ROUTER identity after hello: b"name:pid"
    hello: dict | None = None                    # kind, ops, protocol
    last_heartbeat: float = 0.0                  # monotonic
    status: dict = field(default_factory=dict)   # the last heartbeat's body (state, stats)
    started_wall: float | None = None
    kill_at: float | None = None                 # SIGKILL deadline after a SIGTERM (monotonic)
    boot_reason: str | None = None               # from an `error boot_failed` message
    rss: int | None = None                       # sampled by the table, not per request
    cpu: float | None = None
    heard_at: float = 0.0                        # the table's attention clock at the last heartbeat
    cpu_samples: deque = field(default_factory=deque)   # (monotonic time, CPU seconds used), recent
    sampled_at: float | None = None              # monotonic time of the last progress sample
    advancing: bool = False                      # the CPU time grew over the last liveness window
    stopped: bool = False                        # the process is stopped (SIGSTOP), at the last sample
    spared: bool = False                         # this silence was excused once (busy on CPU)

    @property
    def kind(self) -> str:
        return self.spec["kind"]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def worker_state(self) -> str | None:
        """What the process last said it was doing; None once there is no process (its last
        stats stay in `status`, its last state would be a lie: `stopped/loading`)."""
        return self.status.get("state") if self.proc is not None else None

    def can_serve(self) -> bool:
        """Hello received and not loading: a request sent now is answered by this process."""
        return self.identity is not None and serving(self.ps.state, self.worker_state)

    def describe(self, now_wall: float) -> dict:
        ps = self.ps
        up = now_wall - self.started_wall if self.pid and self.started_wall else None
        return {
            "name": self.name, "kind": self.kind, "state": ps.state, "pid": self.pid,
            "uptime_s": round(up, 3) if up is not None else None,
            "restarts": ps.restarts, "last_exit": ps.last_exit, "reason": ps.reason,
            "rss_bytes": self.rss if self.pid else None, "cpu_percent": self.cpu if self.pid else None,
            "worker_state": self.worker_state,
            "stats": {k: v for k, v in self.status.items() if k != "state"},
            "ops": (self.hello or {}).get("ops", []),
            "model": self.spec.get("model") if self.kind != "test" else None,
            "node": self.node,
            "group": self.spec.get("group"),        # copies of one model ([workers.X] replicas) share it
        }

    @property
    def node(self) -> str | None:
        """The cluster node its process runs on (None: this machine, the local backend)."""
        node = getattr(self.proc, "node", None)
        return node.label if node is not None else None
