"""The supervisor's event stream: worker started/exited/fatal, requests retried, job progress.

Each event gets a sequence number. Logs write every event; `kiln status --watch` and the HTTP
route `GET /v1/events` (server-sent events) follow the stream from a sequence number on, waiting
for the next one instead of polling the daemon's internals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

log = logging.getLogger("kiln.supervisor")


class EventLog:
    def __init__(self, keep: int = 1000, clock=time.time):
        self._events: deque = deque(maxlen=keep)
        self._seq = 0
        self._cond = threading.Condition()
        self._clock = clock

    def record(self, event: str, worker: str | None, detail: str, **extra) -> dict:
        with self._cond:
            self._seq += 1
            e = {"seq": self._seq, "ts": self._clock(), "event": event, "worker": worker, "detail": detail, **extra}
            self._events.append(e)
            self._cond.notify_all()
        log.info("%s%s %s", f"[{worker}] " if worker else "", event, detail)
        return e

    @property
    def last_seq(self) -> int:
        return self._seq

    def since(self, after: int = 0, limit: int | None = None) -> list[dict]:
        with self._cond:
            out = [e for e in self._events if e["seq"] > after]
        return out[-limit:] if limit else out

    def wait(self, after: int, timeout: float) -> list[dict]:
        """Events after `after`, waiting up to `timeout` s for one (from a thread that is not the loop)."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > after, timeout)
        return self.since(after)
