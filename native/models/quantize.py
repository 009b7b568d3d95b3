"""`kiln models quantize IN OUT TYPE`: an F32/F16/BF16 GGUF written again in a quantized file type,
byte for byte the file llama.cpp's quantizer (`llama-quantize`, `llama_model_quantize`) writes for the
same input and type without an importance matrix.

The type of each tensor is llama.cpp's mixture (quant_types.py); the rows are quantized by ggml's
reference arithmetic (csrc/quantize.c); the file is laid out as gguf.cpp writes it: the input's
metadata in its order, `general.quantization_version` and `general.file_type` moved to the end,
a split model's `split.*` keys dropped, the tensors in llama.cpp's order, every tensor's data padded
to 32 bytes. The input is read a slab of rows at a time (memory stays bounded whatever the model's
size), the output is written under a temporary name and renamed when whole, with a manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from ..gguf_file import DEFAULT_ALIGNMENT, GGUFError, _Cursor, read_gguf
from .quant_types import FILE_TYPES, SOURCE_TYPES, Mixture, QuantizeError, allows_quantization, llama_order, \
    model_of, n_dims

ALIGN = 32                                    # GGUF_DEFAULT_ALIGNMENT: llama.cpp's output always uses it
SLAB_BYTES = 64 * 2**20                       # float32 rows converted at a time
_DROPPED = ("general.quantization_version", "general.file_type", "split.no", "split.count", "split.tensors.count")


@dataclass(frozen=True)
class Planned:
    name: str
    ne: tuple[int, ...]                        # ggml order (innermost first)
    source: Q
    target: Q

    @property
    def rows(self) -> int:
        return int(np.prod(self.ne[1:], dtype=np.int64)) if len(self.ne) > 1 else 1

    def row_bytes(self, t: Q) -> int:
        block, size = GGML_QUANT_SIZES[t]
        return self.ne[0] // block * size

    @property
    def in_bytes(self) -> int:
        return self.rows * self.row_bytes(self.source)

    @property
    def out_bytes(self) -> int:
        return self.rows * self.row_bytes(self.target)


def plan(path: Path, file_type: str) -> tuple[object, list[Planned], Mixture]:
    """The input read and every tensor's target type, in llama.cpp's order; refusals before any
    byte is written."""
    ft = file_type.upper()
    if ft not in FILE_TYPES:
        raise QuantizeError(f"file type {file_type!r} is not one Kiln writes; choose one of {', '.join(FILE_TYPES)}")
    try:
        g = read_gguf(path, skip_arrays=True)
    except GGUFError as e:
        raise QuantizeError(str(e)) from None
    align = g.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if align != ALIGN:
        raise QuantizeError(f"{path}: general.alignment is {align}; llama.cpp writes quantized files aligned to "
                            f"{ALIGN} and would leave this one inconsistent — convert the model again with the default")
    model = model_of(g.metadata)
    names = llama_order(g.tensors)
    mix = Mixture.start(model, ft, names)
    default = FILE_TYPES[ft][1]
    out = []
    for name in names:
        info = g.tensors[name]
        ne = tuple(reversed(info.shape))
        target = mix.type_of(name, ne, default) if allows_quantization(name, ne) else info.type
        if target != info.type and info.type not in SOURCE_TYPES:
            raise QuantizeError(f"tensor {name!r} is {info.type.name} already; requantizing loses accuracy and "
                                f"llama.cpp refuses it too — quantize from the F16, BF16 or F32 file")
        out.append(Planned(name, ne, info.type, target))
    return g, out, mix


def _kv_spans(g) -> list[tuple[str, bytes]]:
    """Each metadata entry of the input as its raw bytes (key, type and value), in file order."""
    buf = np.memmap(g.path, np.uint8, mode="r")
    mv = memoryview(buf)
    cur = _Cursor(mv, g.path)
    cur.pos = 16
    n_kv = cur.unpack("<Q")
    spans = []
    for _ in range(n_kv):
        at = cur.pos
        key = cur.string()
        vtype = cur.unpack("<I")
        if vtype == 9 and cur.unpack("<I") == 9:                       # GGUF_TYPE_ARRAY of arrays
            raise QuantizeError(f"metadata {key!r} is an array of arrays, which llama.cpp cannot write")
        if vtype == 9:
            cur.pos -= 4
        cur.value(vtype, skip_arrays=True)
        spans.append((key, bytes(mv[at:cur.pos])))
    del mv
    return spans


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def header(g, planned: list[Planned], ftype_id: int) -> bytes:
    """gguf.cpp's header for the output: the metadata, the tensor table, padding to 32."""
    kvs = [raw for key, raw in _kv_spans(g) if key not in _DROPPED]
    kvs.append(_gguf_string("general.quantization_version") + struct.pack("<II", 4, 2))
    kvs.append(_gguf_string("general.file_type") + struct.pack("<II", 4, ftype_id))
    parts = [b"GGUF", struct.pack("<Iqq", 3, len(planned), len(kvs)), *kvs]
    offset = 0
    for p in planned:
        nd = n_dims(p.ne)
        parts.append(_gguf_string(p.name) + struct.pack(f"<I{nd}qIQ", nd, *p.ne[:nd], int(p.target), offset))
        offset += -(-p.out_bytes // ALIGN) * ALIGN
    head = b"".join(parts)
    return head + bytes(-len(head) % ALIGN)


class _HashingWriter:
    """Writes the file and hashes it as it goes (the manifest's whole-file and 64 MiB chunk sums)."""

    def __init__(self, f, chunk: int):
        self.f, self.chunk, self.size = f, chunk, 0
        self.whole, self.part, self.chunks = hashlib.sha256(), hashlib.sha256(), []

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        self.whole.update(mv)
        while len(mv):
            room = self.chunk - self.size % self.chunk
            self.part.update(mv[:room])
            self.size += min(room, len(mv))
            if self.size % self.chunk == 0:
                self.chunks.append(self.part.hexdigest())
                self.part = hashlib.sha256()
            mv = mv[room:]

    def digests(self) -> tuple[str, list[str], int]:
        chunks = self.chunks + ([self.part.hexdigest()] if self.size % self.chunk else [])
        return self.whole.hexdigest(), chunks, self.size


def _as_float32(p: Planned, raw: np.ndarray) -> np.ndarray:
    if p.source == Q.F32:
        x = raw.view(np.float32)
    elif p.source == Q.F16:
        x = raw.view(np.float16).astype(np.float32)
    else:                                                      # BF16: the high half of a float32
        x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if not np.isfinite(x).all():
        raise QuantizeError(f"tensor {p.name!r} holds NaN or infinite values; the model is damaged (llama.cpp "
                            f"refuses it too) — re-download or re-convert it")
    return x


def quantize_model(src: Path, dst: Path, file_type: str, *, threads: int = 0, force: bool = False,
                   progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Write `dst` from `src` in `file_type`; returns what was done (sizes, time, the types used,
    the tensors that fell back to another type). `progress(done, total, tensor)` counts the input's
    bytes; an exception it raises (a cancel) stops the work and leaves no file behind."""
    from .. import kernels
    from .integrity import CHUNK, manifest_path
    C = kernels.compiled_module()
    if C is None or not hasattr(C, "quantize"):
        raise QuantizeError("quantizing needs Kiln's compiled kernels, which this install lacks (reinstall "
                            "with a C compiler present: `pip install --force-reinstall --no-deps kiln`)")
    src, dst = Path(src), Path(dst)
    if dst.exists() and not force:
        raise QuantizeError(f"{dst} exists already; choose another name or pass --force to replace it")
    if dst.exists() and dst.resolve() == src.resolve():
        raise QuantizeError(f"{dst} is the input; write the quantized model to another file")
    g, planned, mix = plan(src, file_type)
    ft = file_type.upper()
    head = header(g, planned, FILE_TYPES[ft][0])
    total_out = len(head) + sum(-(-p.out_bytes // ALIGN) * ALIGN for p in planned)
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if free < total_out:
        raise QuantizeError(f"{dst.parent} has {free / 2**30:.2f} GiB free; the {ft} file needs "
                            f"{total_out / 2**30:.2f} GiB")
    nt = threads or os.cpu_count() or 1
    total_in, done_in, t0 = sum(p.in_bytes for p in planned), 0, time.time()
    fd, tmp_name = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            w = _HashingWriter(f, CHUNK)
            w.write(head)
            for p in planned:
                raw = g.raw(p.name)
                if p.target == p.source:
                    w.write(raw)
                    if progress:
                        progress(done_in + p.in_bytes, total_in, p.name)
                else:
                    step = max(1, SLAB_BYTES // (4 * p.ne[0]))
                    rb_in, rb_out = p.row_bytes(p.source), p.row_bytes(p.target)
                    out = np.empty(min(step, p.rows) * rb_out, np.uint8)
                    for r0 in range(0, p.rows, step):
                        n = min(step, p.rows - r0)
                        x = _as_float32(p, raw[r0 * rb_in:(r0 + n) * rb_in])
                        C.quantize(x, out, int(p.target), n, p.ne[0], nt)
                        w.write(out[:n * rb_out])
                        if progress:
                            progress(done_in + (r0 + n) * rb_in, total_in, p.name)
                w.write(bytes(-p.out_bytes % ALIGN))
                done_in += p.in_bytes
            digest, chunks, size = w.digests()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    seconds = time.time() - t0
    types: dict[str, int] = {}
    for p in planned:
        types[p.target.name] = types.get(p.target.name, 0) + 1
    doc = {"file": dst.name, "size": size, "sha256": digest, "chunk_bytes": CHUNK, "chunks": chunks,
           "source": f"quantize:{src.name}:{ft}", "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    manifest_path(dst).write_text(json.dumps(doc, indent=1))
    return {"output": str(dst), "file_type": ft, "bytes_in": g.file_size, "bytes_out": size, "sha256": digest,
            "seconds": round(seconds, 2), "tensors": len(planned), "types": types,
            "fallbacks": [{"tensor": n, "wanted": a.name, "used": b.name} for n, a, b in mix.fallbacks]}
