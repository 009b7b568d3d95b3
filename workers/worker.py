"""What a worker kind is made of: a `Worker` subclass with `boot()` and ops registered by
`@op("name")`, the `Request` each handler gets, the `Chunk` it may yield, and the two errors it
raises — `BootError` for a configuration it cannot start with, `OpError` for a failure its caller
should read. The runtime that drives it over the supervisor's socket is workers/runtime.py."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from kiln.protocol import Message, vocab

EXIT_BOOT_ERROR = 3


class BootError(Exception):
    """The worker cannot start with this configuration (exit code 3: no restart loop)."""


class OpError(Exception):
    """An op failed in a way the caller should be told about (code + message)."""

    def __init__(self, code: str, message: str, retryable: bool = False):
        super().__init__(message)
        self.code, self.message, self.retryable = code, message, retryable


@dataclass
class Chunk:
    body: Any
    buffers: list[bytes] = field(default_factory=list)


@dataclass
class Request:
    id: str
    op: str
    body: dict
    buffers: list[bytes]
    deadline: float | None
    _cancel: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False              # cancelled because the worker stops (the router retries it)

    def cancelled(self) -> bool:
        return self._cancel.is_set() or (self.deadline is not None and time.time() > self.deadline)


def op(name: str, concurrent: bool = False):
    """Register a Worker method as the handler of op `name`. A concurrent op runs on a thread
    of its own as soon as it arrives (the handler coordinates); others run one at a time."""
    def mark(fn):
        fn._kiln_op = name
        fn._kiln_concurrent = concurrent
        return fn
    return mark


class Upstream(Protocol):
    """What a worker asks of the runtime that drives it (workers/runtime.py's Runtime)."""

    def request_up(self, op: str, body: dict | None, timeout: float, buffers: list | None = None) -> Iterator[Message]: ...


class Worker:
    kind = "base"
    runtime: Upstream | None = None           # set by the runtime; request_up goes through it

    def __init__(self, name: str, settings: dict):
        self.name, self.settings = name, settings
        self.state = vocab.BOOTING

    def boot(self) -> None:
        """Load what the worker needs. Raise BootError for a configuration mistake."""

    def status(self) -> dict:
        """Extra fields for heartbeats (stats the supervisor shows)."""
        return {}

    def on_stop(self) -> None:
        """Shutdown or SIGTERM arrived (main thread): ask background work to wind down."""

    def stop_pending(self) -> bool:
        """True while background work is still winding down (e.g. writing a checkpoint);
        the process exits when it turns False, or after `stop_grace` seconds."""
        return False

    stop_grace: float | None = None     # seconds it needs to wind down; None: 5 s and the
                                        # supervisor's graceful_timeout (said in hello when set)

    def ops(self) -> dict[str, Callable[[Request], Any]]:
        found = {}
        for cls in reversed(type(self).__mro__):
            for attr, fn in vars(cls).items():
                if hasattr(fn, "_kiln_op"):
                    found[fn._kiln_op] = getattr(self, attr)
        return found

    def request_up(self, op: str, body: dict | None = None, timeout: float = 600.0,
                   buffers: list | None = None) -> Iterator["Message"]:
        """A service of the supervisor (another worker's op, through the router); see Runtime."""
        if self.runtime is None:
            raise OpError("no_supervisor", "this worker runs without a supervisor")
        return self.runtime.request_up(op, body, timeout, buffers)

    def send_up(self, op: str, body: dict | None = None, timeout: float = 600.0, buffers: list | None = None):
        """As request_up, the reply collected later: `.result()` (workers/upcall.py)."""
        if self.runtime is None:
            raise OpError("no_supervisor", "this worker runs without a supervisor")
        return self.runtime.send_up(op, body, timeout, buffers)

    @op("ping")
    def _ping(self, req: Request):
        return {"pong": True, "name": self.name, "pid": os.getpid(), "state": self.state}

    @op("stats")
    def _stats(self, req: Request):
        return {"state": self.state, **self.status()}


def state_dir() -> Path:
    """Kiln's state folder, as the supervisor passes it (KILN_STATE_DIR)."""
    return Path(os.environ.get("KILN_STATE_DIR") or os.environ.get("KILN_HOME") or Path.home() / ".kiln")
