"""A request a worker sends up whose answer it collects later: a split model's first stage sends
one part of a prompt to the next stage and computes the next part meanwhile (workers/pipeline.py).
`Runtime.request_up` is the streaming form; this one waits for the reply alone."""

from __future__ import annotations

import queue
import time
from typing import Iterator

from kiln.protocol import Message, make

from .worker import OpError


class UpCall:
    def __init__(self, runtime, op: str, body: dict, timeout: float, buffers: list | None = None):
        self.runtime, self.op, self.timeout = runtime, op, timeout
        msg = make("request", op=op, body=body, deadline=time.time() + timeout, buffers=buffers)
        self.id, self.q = msg.id, queue.Queue()
        self.deadline = time.monotonic() + timeout + 5
        runtime.upward[msg.id] = self.q
        runtime.post_up(msg)

    def messages(self) -> Iterator[Message]:
        """Each chunk, then the reply; an error raises OpError with the router's code. Left
        before the reply, the request is cancelled (the router drops it)."""
        done = False
        try:
            while True:
                try:
                    m = self.q.get(timeout=max(0.01, min(0.25, self.deadline - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() > self.deadline:
                        raise OpError("timeout", f"the supervisor did not answer {self.op} within {self.timeout:g} s",
                                      retryable=True) from None
                    continue
                if m.type == "error":
                    done = True
                    raise OpError(m.get("code") or "error", m.get("message") or "", bool(m.get("retryable")))
                done = m.type == "reply"
                yield m
                if done:
                    return
        finally:
            self.runtime.upward.pop(self.id, None)
            if not done:
                self.runtime.post_up(make("cancel", id=self.id))

    def result(self) -> Message:
        """The reply alone (chunks skipped)."""
        for m in self.messages():
            last = m
        return last
