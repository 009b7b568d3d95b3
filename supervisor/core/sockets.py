"""What arrives on the daemon's two sockets: frames decoded and their signatures checked (a refused
frame is counted, a peer of another protocol version told which one this is), workers' hellos,
heartbeats and answers handed to the process table and the router, the CLI's requests and
commands run — a mixin of the Supervisor (supervisor/core/daemon.py), on its loop thread."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable

from kiln.protocol import Message, ProtocolError, decode_frames, encode_frames, make, version_error

from . import registry as commands
from .routing import KIND_OPS, MODEL_OPS, Client, Target, routed_target  # noqa: F401

request_log = logging.getLogger("kiln.requests")
frame_log = logging.getLogger("kiln.frames")          # every worker message: `kiln -vv up`      # the daemon log's request lines (http/observe.py too)


def _logged(op: str, body: dict, deliver: Callable[[Message], None]) -> Callable[[Message], None]:
    """`deliver`, writing the daemon log's request line when the answer ends (`kiln run`, `kiln
    chat` and other CLI requests: the HTTP front end logs its own)."""
    t0 = time.monotonic()

    def send(m: Message) -> None:
        if m.type in ("reply", "error"):
            u = (m.body or {}).get("usage") if m.type == "reply" and isinstance(m.body, dict) else None
            parts = [f"control {op}", f"status={'ok' if m.type == 'reply' else m.get('code')}",
                     f"model={body.get('model') or body.get('worker') or 'default'}"]
            if isinstance(u, dict):
                parts.append(f"prompt_tokens={u.get('prompt_tokens', 0)} completion_tokens={u.get('completion_tokens', 0)}")
            parts.append(f"total_ms={(time.monotonic() - t0) * 1000:.0f}")
            request_log.info("request " + " ".join(parts))
        deliver(m)
    return send


class SocketTraffic:
    def _key(self, sock) -> bytes:
        return self.files.worker_key if sock is getattr(self, "worker_sock", None) else self.files.control_key

    def _send(self, sock, identity: bytes | None, msg: Message) -> None:
        if identity:
            sock.send_multipart([identity] + encode_frames(msg, self._key(sock)))

    def _decode(self, sock, frames: list[bytes]) -> tuple[bytes, Message | None]:
        """(identity, message), or (identity, None) for a refused frame — counted, and a peer of
        another protocol version is told which one this is."""
        identity = frames[0]
        try:
            return identity, decode_frames(frames[1:], self._key(sock))
        except ProtocolError as e:
            self.bad_frames[e.kind] += 1
            if e.kind == "version":
                sock.send_multipart([identity] + version_error(e.peer_version, self._key(sock)))
            return identity, None

    def _on_worker_frames(self, frames: list[bytes], key_owner: str | None = None) -> None:
        """`key_owner`: on a cluster's CURVE socket, the worker the connection's key was issued to
        (ZeroMQ's User-Id): a message naming another worker is refused — a worker's valid key
        never lets it speak for another, nor a revoked one for anyone."""
        if key_owner is not None and frames[0].split(b":")[0].decode(errors="replace") != key_owner:
            self.bad_frames["foreign_key"] += 1
            return
        identity, msg = self._decode(self.worker_sock, frames)
        if msg is None:
            return
        if frame_log.isEnabledFor(logging.DEBUG):
            frame_log.debug("from worker %s: %s %s", identity.hex()[:8], msg.type, msg.id or "")
        if msg.type == "hello":
            hello = {k: msg.get(k) for k in ("kind", "ops", "protocol", "stop_grace", "token")}
            if self.table.on_hello(identity, msg.get("name"), msg.get("pid"), hello, msg.body) is None:
                self.bad_frames["unknown_peer"] += 1
            return
        w = self.table.by_peer(identity)
        if w is None:
            self.bad_frames["unknown_peer"] += 1
            return
        if msg.type == "heartbeat":
            self.table.on_heartbeat(w, msg.body)
        elif msg.type == "error" and msg.get("code") == "boot_failed":
            w.boot_reason = msg.get("message")
        elif msg.type in ("chunk", "reply", "error"):
            self.router.on_worker_message(w, msg)
        elif msg.type == "request":             # a worker asking for a service (the evaluator: generate)
            self.router.on_worker_request(w, msg, lambda m, ident=identity: self._send(self.worker_sock, ident, m))
        elif msg.type == "cancel":
            self.router.cancel_client(msg.id, f"worker:{w.name}")
        else:
            self.bad_frames["unexpected_type"] += 1

    def _on_control_frames(self, frames: list[bytes]) -> None:
        identity, msg = self._decode(self.control, frames)
        if msg is None:
            return
        origin = f"control:{identity.hex()}"
        if msg.type == "cancel":
            self.router.cancel_client(msg.id, origin)
            return
        if msg.type != "request":
            self.bad_frames["unexpected_type"] += 1
            return
        op = msg.get("op")
        body = msg.body if isinstance(msg.body, dict) else {}
        client = Client(msg.id, lambda m: self._send(self.control, identity, m), origin)
        if op == "call":
            timeout = body.get("timeout")
            if not isinstance(body.get("worker"), str) or not isinstance(body.get("op"), str) \
                    or not (timeout is None or isinstance(timeout, (int, float))):
                return client.deliver(make("error", id=msg.id, code="bad_request",
                                           message="call needs {worker: str, op: str, body?, timeout?: number}"))
            return self.router.submit(body["op"], body.get("body"), client, Target(worker=body["worker"]),
                                      float(timeout) if timeout else None)
        if op in MODEL_OPS or op in KIND_OPS:
            if op in MODEL_OPS:                        # a line in the daemon log, as an HTTP request has
                client.deliver = _logged(op, body, client.deliver)
            timeout = body.get("timeout") if op in MODEL_OPS else None
            worker_op, wbody, target = routed_target(op, {k: v for k, v in body.items() if k != "timeout"})
            submit = lambda: self.router.submit(worker_op, wbody, client, target,  # noqa: E731
                                                float(timeout) if isinstance(timeout, (int, float)) else None)
            return self._prepared(target.model, submit)
        if op == "load" and isinstance(body.get("model"), str):
            return self._prepared(body["model"], lambda: self._run_command(client, msg.id, op, body))
        if op in commands.OFF_LOOP:
            fut = self.offloop.submit(commands.run, self, op, body)
            fut.add_done_callback(lambda f: self.submit(lambda: self._command_done(client, f)))
            return
        self._run_command(client, msg.id, op, body)

    def _run_command(self, client: Client, msg_id: str, op: str, body: dict) -> None:
        try:
            result = commands.run(self, op, body)
        except commands.CommandError as e:
            return client.deliver(make("error", id=msg_id, code=e.code, message=e.message))
        client.deliver(make("reply", id=msg_id, body=result))

    def _prepared(self, model: str | None, then: Callable[[], None]) -> None:
        """`then` on the loop, once `model` is planned off it (when it names one to place)."""
        if not model or self.placer is None:
            return then()
        fut = self.offloop.submit(self.placer.prepare, model)
        fut.add_done_callback(lambda f: self.submit(then))

    @staticmethod
    def _command_done(client: Client, fut: Future) -> None:
        try:
            client.deliver(make("reply", id=client.id, body=fut.result()))
        except commands.CommandError as e:
            client.deliver(make("error", id=client.id, code=e.code, message=e.message))
        except Exception as e:  # noqa: BLE001 - a command's bug is an answer, not a dead loop
            client.deliver(make("error", id=client.id, code="internal_error", message=f"{type(e).__name__}: {e}"))
