"""Split a GGUF file as llama.cpp's `llama-gguf-split --split` does: part 1 holds all the
metadata, every part `split.no` (u16, 0-based), `split.count` (u16) and `split.tensors.count`
(i32) and its share of the tensors, each named NAME-0000i-of-0000n.gguf. Written from the
original's own bytes (gguf-py reads the fields' raw parts), so the tensors are the same bytes."""

from __future__ import annotations

import struct
from pathlib import Path

from gguf import GGUFReader



def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _split_kvs(no: int, count: int, total: int) -> list[bytes]:
    return [_string("split.no") + struct.pack("<IH", 2, no), _string("split.count") + struct.pack("<IH", 2, count),
            _string("split.tensors.count") + struct.pack("<Ii", 5, total)]


def split(path: Path, out_dir: Path, n_parts: int, lie: dict | None = None) -> list[Path]:
    """`lie`: {part index: {"no" | "count" | "total": value}} written instead of the truth (hostile files)."""
    r = GGUFReader(path)
    align = int(r.alignment)
    kvs = [b"".join(p.tobytes() for p in f.parts) for name, f in r.fields.items() if not name.startswith("GGUF.")]
    tensors = list(r.tensors)
    per = -(-len(tensors) // n_parts)
    stem = path.name.removesuffix(".gguf")
    out = []
    for i in range(n_parts):
        mine = tensors[i * per:(i + 1) * per]
        said = {"no": i, "count": n_parts, "total": len(tensors), **(lie or {}).get(i, {})}
        header_kvs = (kvs if i == 0 else []) + _split_kvs(said["no"], said["count"], said["total"])
        infos, data, at = [], [], 0
        for t in mine:
            raw = bytes(t.data.tobytes())
            ne = [int(d) for d in t.field.parts[3]]            # ggml's order, as stored
            infos.append(_string(t.name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                         + struct.pack("<IQ", int(t.tensor_type), at))
            pad = -len(raw) % align
            data.append(raw + b"\0" * pad)
            at += len(raw) + pad
        head = b"GGUF" + struct.pack("<IQQ", 3, len(mine), len(header_kvs)) + b"".join(header_kvs) + b"".join(infos)
        head += b"\0" * (-len(head) % align)
        p = out_dir / f"{stem}-{i + 1:05d}-of-{n_parts:05d}.gguf"
        p.write_bytes(head + b"".join(data))
        out.append(p)
    return out
