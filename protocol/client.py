"""A client of the supervisor's command bus over its control socket: named commands, and
routed ops (generate, train.submit, …) and `call`s of a named worker's op, chunks streamed back.
The CLI uses it. Workers never do: they send their requests up their own socket."""

from __future__ import annotations

import time
from typing import Any, Iterator

import zmq

from .wire import Message, ProtocolError, decode_frames, encode_frames, make


class CommandFailed(RuntimeError):
    def __init__(self, code: str, message: str, retryable: bool = False):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.retryable = code, message, retryable


class BusClient:
    def __init__(self, endpoint: str, key: bytes, timeout: float = 15.0, peer: str = "the daemon"):
        self.key, self.timeout, self.peer = key, timeout, peer
        self.last_call_id: str | None = None
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _recv(self, timeout: float) -> Message:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(left * 1000):
                raise TimeoutError(f"{self.peer} did not answer within {timeout:g} s")
            try:
                return decode_frames(self.sock.recv_multipart(), self.key)
            except ProtocolError:
                continue

    def command(self, name: str, args: dict | None = None, timeout: float | None = None) -> Any:
        msg = make("request", op=name, body=args or {})
        self.sock.send_multipart(encode_frames(msg, self.key))
        while True:
            reply = self._recv(timeout or self.timeout)
            if reply.id != msg.id:
                continue
            if reply.type == "error":
                raise CommandFailed(reply.get("code"), reply.get("message"), bool(reply.get("retryable")))
            return reply.body

    def stream(self, op: str, body: Any = None, timeout: float = 60.0) -> Iterator[Message]:
        """Send a routed op (generate, score, train.submit, …) or a `call`; yield each chunk, then
        the reply (or raise CommandFailed on an error)."""
        msg = make("request", op=op, body=body or {})
        self.sock.send_multipart(encode_frames(msg, self.key))
        self.last_call_id = msg.id
        while True:
            m = self._recv(timeout + 5)
            if m.id != msg.id:
                continue
            if m.type == "error":
                raise CommandFailed(m.get("code"), m.get("message"), bool(m.get("retryable")))
            yield m
            if m.type == "reply":
                return

    def call(self, worker: str, op: str, body: Any = None, timeout: float = 60.0) -> Iterator[Message]:
        """Send op to one named worker through the daemon's router; yield each chunk, then the
        reply (or raise CommandFailed on an error)."""
        return self.stream("call", {"worker": worker, "op": op, "body": body, "timeout": timeout}, timeout)

    def cancel(self, call_id: str) -> None:
        self.sock.send_multipart(encode_frames(make("cancel", id=call_id), self.key))
