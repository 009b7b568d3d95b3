"""Kiln's wire format: signed, versioned, self-describing ZeroMQ multipart messages.

    [identity]* | b"KILN/1" | hmac-sha256(key, frames that follow) | msgpack(header) | msgpack(body) [| raw buffers]

The version frame comes first so a peer can refuse another version without parsing the rest.
The signature covers every frame after it (each length-prefixed, so frames cannot be shifted).
Raw buffers (numpy data) travel as extra frames, outside msgpack.

`encode_frames` and `decode_frames` are the only way in and out; every defect of an incoming
message raises `ProtocolError` with a readable reason and a `kind` the receiver can count.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_NAME = b"KILN"
PROTOCOL_VERSION = 1
VERSION_FRAME = b"KILN/%d" % PROTOCOL_VERSION

TYPES = ("hello", "heartbeat", "request", "chunk", "reply", "error", "cancel", "shutdown")

# Header fields each type must carry, beyond id/type/ts, with their types.
_REQUIRED: dict[str, dict[str, type | tuple]] = {
    "hello": {"name": str, "kind": str, "pid": int, "protocol": int, "ops": list},
    "heartbeat": {},
    "request": {"op": str},
    "chunk": {"seq": int},
    "reply": {},
    "error": {"code": str, "message": str},
    "cancel": {},
    "shutdown": {},
}
_OPTIONAL: dict[str, type | tuple] = {"deadline": (int, float), "retryable": bool, "worker": str,
                                       "re": str, "token": str}
MAX_HEADER_BYTES = 64 * 1024


class ProtocolError(Exception):
    """An incoming message is not a valid Kiln message.

    kind: "version" (another protocol version: `peer_version` says which), "signature",
    or "malformed"."""

    def __init__(self, reason: str, kind: str = "malformed", peer_version: str | None = None):
        super().__init__(reason)
        self.reason, self.kind, self.peer_version = reason, kind, peer_version


@dataclass
class Message:
    type: str
    id: str
    header: dict[str, Any]
    body: Any = None
    buffers: list[bytes] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)


_counter = itertools.count()
_prefix = f"{os.getpid():x}-{os.urandom(3).hex()}"


def new_id() -> str:
    """Unique within this process and distinct across processes."""
    return f"{_prefix}-{next(_counter):x}"


MAX_MESSAGE_CHARS = 8 * 1024   # an error's message rides in the header: one that quotes a huge input
                               # must still fit MAX_HEADER_BYTES, or the answer would be dropped unseen


def make(type_: str, *, id: str | None = None, body: Any = None,
         buffers: list[bytes] | None = None, **fields: Any) -> Message:
    msg = fields.get("message")
    if isinstance(msg, str) and len(msg) > MAX_MESSAGE_CHARS:
        fields["message"] = f"{msg[:MAX_MESSAGE_CHARS]}… ({len(msg) - MAX_MESSAGE_CHARS} characters cut)"
    header = {"type": type_, "id": id or new_id(), "ts": time.time(), **fields}
    return Message(type_, header["id"], header, body, list(buffers or []))


def _sign(key: bytes, frames: list[bytes]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for f in frames:
        mac.update(len(f).to_bytes(8, "little"))
        mac.update(f)
    return mac.hexdigest().encode()


def encode_frames(msg: Message, key: bytes) -> list[bytes]:
    """The frames of `msg` (without routing identities), signed with `key`."""
    if msg.type not in TYPES:
        raise ValueError(f"unknown message type {msg.type!r}")
    header = dict(msg.header, type=msg.type, id=msg.id)
    payload = [msgpack.packb(header, use_bin_type=True),
               msgpack.packb(msg.body, use_bin_type=True)]
    payload += [bytes(b) for b in msg.buffers]
    return [VERSION_FRAME, _sign(key, payload)] + payload


def decode_frames(frames: list[bytes], key: bytes) -> Message:
    """Validate and decode the frames of one message (routing identities already removed)."""
    if not isinstance(frames, (list, tuple)) or len(frames) < 4:
        n = len(frames) if isinstance(frames, (list, tuple)) else "?"
        raise ProtocolError(f"a message has at least 4 frames (version, signature, header, body); got {n}")
    frames = [bytes(f) for f in frames]
    version = frames[0]
    if version != VERSION_FRAME:
        if version.startswith(PROTOCOL_NAME + b"/"):
            peer = version.decode("ascii", errors="replace")[:32]
            raise ProtocolError(f"protocol version {peer} is not supported; this peer speaks "
                                f"{VERSION_FRAME.decode()}", kind="version", peer_version=peer)
        raise ProtocolError(f"first frame must be the protocol version {VERSION_FRAME.decode()}, "
                            f"got {version[:16]!r}")
    if not hmac.compare_digest(frames[1], _sign(key, frames[2:])):
        raise ProtocolError("bad signature (wrong key, or the message was altered)", kind="signature")
    if len(frames[2]) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frames[2])} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(frames[2], raw=False, strict_map_key=True)
        body = msgpack.unpackb(frames[3], raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on garbage
        raise ProtocolError(f"undecodable msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    mtype = header.get("type")
    if mtype not in TYPES:
        raise ProtocolError(f"unknown message type {mtype!r} (known: {', '.join(TYPES)})")
    for name, kind in {"id": str, "ts": (int, float), **_REQUIRED[mtype]}.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool) and kind is int:
            raise ProtocolError(f"{mtype} header field {name!r} is missing or not "
                                f"{getattr(kind, '__name__', 'a number')}")
    for name, kind in _OPTIONAL.items():
        if name in header and not isinstance(header[name], kind):
            raise ProtocolError(f"{mtype} header field {name!r} has the wrong type")
    return Message(mtype, header["id"], header, body, frames[4:])


def version_error(peer_version: str | None, key: bytes) -> list[bytes]:
    """The frames answering a peer that spoke another protocol version."""
    peer = peer_version or "an unknown version"
    return encode_frames(make("error", code="unsupported_version",
                              message=f"this peer speaks {VERSION_FRAME.decode()}, not {peer}",
                              body={"supported": VERSION_FRAME.decode(), "received": peer}), key)
