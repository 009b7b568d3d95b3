"""Talking to a running daemon over its control socket (what the CLI and tests use)."""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

import zmq

from kiln.protocol import Message, ProtocolError, decode_frames, encode_frames, make

from .daemon import read_pid
from .paths import Paths


class DaemonNotRunning(RuntimeError):
    pass


class CommandFailed(RuntimeError):
    def __init__(self, code: str, message: str, retryable: bool = False):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.retryable = code, message, retryable


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


class ControlClient:
    def __init__(self, paths: Paths | None = None, timeout: float = 15.0):
        self.paths = paths or Paths.from_env()
        self.timeout = timeout
        self.pid = daemon_pid(self.paths)
        if self.pid is None or not self.paths.keyfile.exists():
            raise DaemonNotRunning(f"kiln is not running (no daemon for KILN_HOME={self.paths.home}); "
                                   f"start it with `kiln up`")
        try:
            self.key = self.paths.keyfile.read_bytes()
        except PermissionError:
            raise DaemonNotRunning(f"cannot read {self.paths.keyfile}: the daemon belongs to another user") from None
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.paths.control_endpoint)

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
                raise TimeoutError(f"the daemon (pid {self.pid}) did not answer within {timeout:g} s")
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

    def call(self, worker: str, op: str, body: Any = None, timeout: float = 60.0) -> Iterator[Message]:
        """Send op to a worker through the daemon; yield each chunk, then the reply (or raise
        CommandFailed on an error)."""
        msg = make("request", op="call", body={"worker": worker, "op": op, "body": body, "timeout": timeout})
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

    def cancel(self, call_id: str) -> None:
        self.sock.send_multipart(encode_frames(make("cancel", id=call_id), self.key))
