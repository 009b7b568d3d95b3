"""Floods are refused, not queued forever: waitress has `server.threads` threads, and a request that
streams (a generation, the event stream) holds one for as long as it runs. Without a bound, 16 open
event streams or 64 streaming requests took every thread, and `/health`, `/metrics` and the
control routes waited behind them with no answer at all.

So long requests may hold at most `threads - RESERVED` threads, event streams at most
`server.max_event_streams`; past that a request is answered 503 `server_busy` with Retry-After at
once. Short requests (reads, health, control actions) are never refused here: the reserved threads
are theirs.
"""

from __future__ import annotations

import re
import threading

from .common import JSONError

RESERVED = 4      # threads only short requests may use
# control actions: quick, and what a user needs most when the daemon is flooded
_CONTROL = re.compile(r"/v1/(workers/[^/]+/\w+|models/[^/]+/(load|unload)|adapters/.*|"
                      r"(train|eval)/jobs/[^/]+)")


def kind_of(req) -> str:
    """'events', 'long' (generation and anything else that may run a while) or 'short'."""
    if req.path == "/v1/events":
        return "events"
    if req.method in ("GET", "HEAD", "OPTIONS") or _CONTROL.fullmatch(req.path):
        return "short"
    return "long"


class Admission:
    def __init__(self, threads: int, max_event_streams: int):
        self.long_max = max(1, threads - RESERVED)
        self.events_max = max(1, min(max_event_streams, self.long_max))
        self.lock = threading.Lock()
        self.held = {"long": 0, "events": 0}

    def process_request(self, req, resp):
        kind = kind_of(req)
        if kind == "short":
            return
        with self.lock:
            busy = self.held["long"] + self.held["events"]
            if busy >= self.long_max:
                raise JSONError(503, "server_busy", f"server busy: {busy} requests are streaming or running "
                                f"(server.threads = {self.long_max + RESERVED}, {RESERVED} kept for health and "
                                f"control); retry later", headers={"Retry-After": "1"})
            if kind == "events" and self.held["events"] >= self.events_max:
                raise JSONError(503, "server_busy", f"{self.held['events']} event streams are open "
                                f"(server.max_event_streams = {self.events_max}); close one or retry later",
                                headers={"Retry-After": "5"})
            self.held[kind] += 1
        req.context.admitted = kind

    def process_response(self, req, resp, resource, req_succeeded):
        kind = getattr(req.context, "admitted", None)
        if kind is None:
            return
        req.context.admitted = None
        if resp.stream is not None:          # held until the server has sent the whole stream
            resp.stream = _ReleasedOnClose(resp.stream, lambda: self._release(kind))
        else:
            self._release(kind)

    def _release(self, kind: str) -> None:
        with self.lock:
            self.held[kind] -= 1

    def snapshot(self) -> dict:
        with self.lock:
            return {"long": self.held["long"], "events": self.held["events"], "long_max": self.long_max,
                    "events_max": self.events_max}


class _ReleasedOnClose:
    """A response stream that gives its slot back when the WSGI server closes it — after the last
    byte, or when the client went away (waitress closes the iterable either way)."""

    def __init__(self, stream, release):
        self.stream, self._release = stream, release

    def __iter__(self):
        return iter(self.stream)

    def close(self):
        release, self._release = self._release, None
        try:
            close = getattr(self.stream, "close", None)
            if close is not None:
                close()
        finally:
            if release is not None:
                release()
