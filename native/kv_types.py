"""What a KV cache holds: fp16 (the default, as llama.cpp), float32 (for comparisons), or ggml's
8- and 4-bit blocks — q8_0 and q4_0, llama.cpp's `-ctk/-ctv` and Ollama's OLLAMA_KV_CACHE_TYPE.

A quantized row of head_dim values is head_dim/32 blocks, each an fp16 scale and 32 codes, held
in a numpy structured array (positions, kv heads, blocks) so that the type travels with the
buffer: the kernels read the blocks directly; only the numpy reference path widens them.

As llama.cpp does, a quantized cache holds its rows rotated by an orthonormal Walsh-Hadamard
matrix (keys: of the largest power of two from 64 dividing head_dim, values: of 64) and the
queries are rotated alike, so q·k is unchanged while an outlier is spread over its block: at
4 bits the attention is several times closer to fp16's (rotation()).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class KVType(NamedTuple):
    name: str
    ggml: int                 # ggml's type id, as the kernels take it
    dtype: np.dtype           # one element of a row: a value, or a block of 32
    block: int                # values per element

    def row_bytes(self, head_dim: int) -> int:
        return head_dim // self.block * self.dtype.itemsize

    @property
    def bytes_per_value(self) -> float:
        return self.dtype.itemsize / self.block


Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
Q4_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])

KV_TYPES = {
    "f16": KVType("f16", 1, np.dtype(np.float16), 1),
    "q8_0": KVType("q8_0", 8, Q8_0_BLOCK, 32),
    "q4_0": KVType("q4_0", 2, Q4_0_BLOCK, 32),
    "f32": KVType("f32", 0, np.dtype(np.float32), 1),
}
DEFAULT_KV_TYPE = "f16"
# what users may choose (f32 stays a comparison tool: twice the memory, farther from llama.cpp)
KV_TYPE_NAMES = ("f16", "q8_0", "q4_0")


class KVTypeError(ValueError):
    pass


def kv_type(spec) -> KVType:
    """A KVType from its name ("f16", "q8_0", "q4_0", "f32"; case-insensitive), a numpy dtype
    or a KVType."""
    if isinstance(spec, KVType):
        return spec
    if isinstance(spec, str):
        t = KV_TYPES.get(spec.strip().lower())
        if t is None:
            raise KVTypeError(f"kv cache type {spec!r} is not one of {', '.join(KV_TYPE_NAMES)}")
        return t
    dt = np.dtype(spec)
    for t in KV_TYPES.values():
        if t.dtype == dt:
            return t
    raise KVTypeError(f"no KV cache type holds {dt}")


def settings_kv(settings: dict) -> tuple[str, str]:
    """A model worker's (keys, values) types from its settings: kv_type_k / kv_type_v, else
    kv_type, else f16 (the supervisor has given a worker without its own the [models] ones)."""
    both = settings.get("kv_type") or DEFAULT_KV_TYPE
    return settings.get("kv_type_k") or both, settings.get("kv_type_v") or both


def rotation(t: KVType, head_dim: int, keys: bool) -> int:
    """The Walsh-Hadamard rotation (its size; 0: none) a cache of type t applies to its keys or
    values — llama.cpp's attn_rot_k / attn_rot_v (csrc/kv_quant.c kv_rot)."""
    if t.block == 1 or head_dim <= 0 or head_dim % 64:
        return 0
    if not keys:
        return 64
    n = 64
    while 2 * n <= head_dim and head_dim % (2 * n) == 0:
        n *= 2
    return n


def fwht(x: np.ndarray, n: int) -> np.ndarray:
    """x (..., D) float32 times the orthonormal Walsh-Hadamard matrix of size n, block by block:
    scaled by 1/sqrt(n), then the butterflies from stride 1 up — ggml's fwht, bit for bit."""
    shape = x.shape
    y = (x.astype(np.float32) * np.float32(1.0 / np.sqrt(np.float32(n)))).reshape(-1, n)
    length = 1
    while length < n:
        z = y.reshape(-1, n // (2 * length), 2, length)
        u, v = z[:, :, 0, :], z[:, :, 1, :]
        y = np.stack([u + v, u - v], axis=2).reshape(-1, n)
        length *= 2
    return y.reshape(shape)


def check_head_dim(t: KVType, head_dim: int) -> None:
    if head_dim % t.block:
        raise KVTypeError(f"kv cache type {t.name} stores blocks of {t.block} values; this model's "
                          f"head_dim {head_dim} is not a multiple of it — use f16")


def encode(t: KVType, x: np.ndarray, rot: int = 0) -> np.ndarray:
    """x (..., head_dim) float32 as t's elements (..., head_dim / block), numpy's way: fp16 rounds
    to nearest even; q8_0 is AVX2 ggml's (scale amax/127, codes round(x·127/amax)); q4_0 is
    ggml's reference quantizer; rotated first by `rot` (rotation()). The compiled kv_store gives
    the same bits."""
    if t.block == 1:
        return x.astype(t.dtype)
    if rot:
        x = fwht(x, rot)
    b = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    out = np.empty(b.shape[:-1], t.dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        if t.name == "q8_0":
            amax = np.abs(b).max(axis=-1)
            iscale = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
            out["d"] = (amax / np.float32(127)).astype(np.float16)
            out["qs"] = np.clip(np.rint(b * iscale[..., None]), -127, 127).astype(np.int8)
        else:
            at = np.abs(b).argmax(axis=-1)
            mx = np.take_along_axis(b, at[..., None], axis=-1)[..., 0]
            d = (mx / np.float32(-8)).astype(np.float32)
            iscale = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
            codes = np.minimum(15, (b * iscale[..., None] + np.float32(8.5)).astype(np.int8)).astype(np.uint8)
            out["d"] = d.astype(np.float16)
            out["qs"] = codes[..., :16] | (codes[..., 16:] << 4)
    return out


def decode(a: np.ndarray, rot: int = 0) -> np.ndarray:
    """t's elements (..., n) back to float32 values (..., n · block), the rotation `rot` undone."""
    if a.dtype.fields is None:
        return a.astype(np.float32)
    d = a["d"].astype(np.float32)[..., None]
    if a.dtype == Q8_0_BLOCK:
        v = a["qs"].astype(np.float32)
    else:
        qs = a["qs"]
        v = np.concatenate([(qs & 0x0F).astype(np.float32) - 8, (qs >> 4).astype(np.float32) - 8], axis=-1)
    out = (d * v).reshape(*a.shape[:-1], a.shape[-1] * 32)
    return fwht(out, rot) if rot else out
