"""The file a cache's rows are kept in — a prefix cache's block (native/prefix_cache.py) or a
whole saved slot (llama-server's /slots save/restore): a header that says what the rows are
(the model file's identity, cache types and shapes, the tokens they hold) and a sha256 of them, then
the rows. Written to a temporary name and renamed, so a reader never sees half a file; read
back only when every byte checks out — a file is an input like any other."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"KILNKVB\0"
VERSION = 1
_HEAD = struct.Struct("<8sII")          # magic, version, header length
MAX_HEADER = 4 << 20                    # a header lists tokens: a whole context's, at most


class KVFileError(ValueError):
    """Why a file is not the rows asked for (said in the words a log line or an answer needs)."""


def write(path: Path, header: dict, payload: np.ndarray) -> int:
    """Write header (plus payload_bytes and payload_sha256) and the rows; the bytes written."""
    head = json.dumps({**header, "payload_bytes": int(payload.nbytes),
                       "payload_sha256": hashlib.sha256(payload).hexdigest()}).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, VERSION, len(head)) + head)
            f.write(payload.data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _HEAD.size + len(head) + payload.nbytes


def read_header(f, want: dict) -> dict:
    """The header of an open KV file (positioned at its start), checked against `want` (every
    field of it equal); KVFileError saying why not. The file is left at its rows."""
    raw = f.read(_HEAD.size)
    if len(raw) < _HEAD.size:
        raise KVFileError("is shorter than its header")
    magic, version, n = _HEAD.unpack(raw)
    if magic != MAGIC or version != VERSION or not 0 < n <= MAX_HEADER:
        raise KVFileError("is not a Kiln KV file of this version")
    raw = f.read(n)
    try:
        head = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise KVFileError("has a header that is not JSON") from None
    if not isinstance(head, dict):
        raise KVFileError("has a header that is not an object")
    for field, value in want.items():
        if head.get(field) != value:
            raise KVFileError(f"is not what was asked for ({field} differs: another model, cache type or prompt)")
    return head


def read(path: Path, want: dict, max_bytes: int) -> tuple[dict, np.ndarray]:
    """(header, rows) of the file at `path` when its header holds every field of `want` with that
    value and its rows are whole and match their checksum; KVFileError saying why not.
    `max_bytes`: the largest file the caller could use (a bigger one is not read)."""
    try:
        size = path.stat().st_size
        if size > max_bytes + MAX_HEADER + _HEAD.size:
            raise KVFileError(f"is {size} bytes, more than rows of this cache can be")
        with open(path, "rb") as f:
            head = read_header(f, want)
            payload = np.frombuffer(f.read(), np.uint8)
    except OSError as e:
        raise KVFileError(f"cannot be read ({e.strerror or e})") from None
    if payload.nbytes != head.get("payload_bytes"):
        raise KVFileError(f"holds {payload.nbytes} bytes of rows, not the {head.get('payload_bytes')} it says (truncated)")
    if hashlib.sha256(payload).hexdigest() != head.get("payload_sha256"):
        raise KVFileError("does not match its checksum (damaged)")
    return head, payload
