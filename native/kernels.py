"""The kernel interface the forward pass calls: `matmul(x, W)` with W a `Weight`.

The compiled kernels (_kernels, csrc/) multiply the stored blocks directly. Without them the
numpy path runs: for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F32 it reproduces the kernels' arithmetic bit for bit
(ggml_round.py), for the other types it multiplies a float32 copy dequantized with
`gguf.quants.dequantize`. Nothing above this module knows which path runs.

Activations are quantized the way ggml's CPU kernels quantize them before a dot product with a
quantized weight (`vec_dot_type`: Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the
K-quants, fp16 for F16). This is not a speed trick here: it reproduces llama.cpp's arithmetic,
and measured against its reference it moves near-tie greedy tokens to llama.cpp's choice
(SmolLM2 prompt 0, token 5: margin 0.27 in llama.cpp, flipped without it).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from . import blas_threads, ggml_round
from .gguf_file import GGUFError, GGUFFile, TensorInfo
from .kv_types import KVType, decode, encode, kv_type, rotation

SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                   Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S,
                   Q.IQ1_S, Q.IQ1_M, Q.MXFP4)

# which SIMD kernels the compiled extension picks (it reads the variable itself): a value it does
# not know would be silently the default, so it is refused here, naming what is allowed
if os.environ.get("KILN_SIMD", "auto") not in ("auto", "avx2"):
    raise RuntimeError(f"KILN_SIMD={os.environ['KILN_SIMD']!r} is not a kernel choice: use 'avx2' (the AVX2 "
                       "kernels only) or 'auto' (the widest this CPU has; the default), or unset it")

try:
    from . import _kernels as _C
except ImportError:          # built without a C compiler: the numpy path serves
    _C = None

COMPILED_TYPES = frozenset((Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                            Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4)) if _C else frozenset()
_compiled_on = _C is not None and os.environ.get("KILN_NATIVE_KERNELS", "1") != "0"
blas_threads.for_engine(_compiled_on)


def use_compiled(on: bool) -> bool:
    """Switch between the compiled kernels and the numpy path; returns the previous setting.
    (KILN_NATIVE_KERNELS=0 starts on the numpy path.)"""
    global _compiled_on
    previous, _compiled_on = _compiled_on, bool(on) and _C is not None
    blas_threads.for_engine(_compiled_on)
    return previous


def kernel_info() -> dict:
    """Which path runs and with which CPU features — for `kiln health` and `models inspect`."""
    if not _compiled_on:
        why = "disabled (KILN_NATIVE_KERNELS=0)" if _C is not None else "extension not built"
        return {"path": "numpy", "compiled": why, "activation_rounding": _act_mode}
    f = _C.features()
    return {"path": "compiled", "avx2_fma": f["avx2_fma"], "avx512_vnni": f["avx512_vnni"], "openmp": f["openmp"],
            "threads": f["threads"] or f["max_threads"], "activation_rounding": "ggml"}


def set_threads(n: int) -> None:
    if _C is not None:
        _C.set_threads(int(n))


def max_threads() -> int:
    """The threads the compiled kernels may use at most (OpenMP's count; 1 on the numpy path)."""
    return int(_C.features()["max_threads"]) if _compiled_on else 1


def attention_compiled(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int,
                       scale: float | None = None, window: int = 0,
                       sinks: np.ndarray | None = None) -> np.ndarray | None:
    """Causal attention in C (batch-invariant) over a cache of any KV type (the type of k and of
    v is their dtype), or None when the numpy path runs."""
    if not _compiled_on:
        return None
    T, H, d = q.shape
    S, Hkv = k.shape[:2]
    out = np.empty((T, H * d), np.float32)
    # k, v as they are: a cache's head-major buffers, read through their strides (csrc/kiln.h KvView)
    _C.attention(np.ascontiguousarray(q), _kv_readable(k), _kv_readable(v), out,
                 T, H, Hkv, d, S, start, 0, kv_type(k.dtype).ggml, kv_type(v.dtype).ggml,
                 float(scale or 0.0), int(window),
                 *(() if sinks is None else (np.ascontiguousarray(sinks, np.float32),)))
    return out


def _kv_readable(a: np.ndarray) -> np.ndarray:
    """A cache array the compiled attention reads in place (positive strides, each row
    contiguous), else a contiguous copy."""
    ok = a.ndim == 3 and a.strides[2] == a.itemsize and a.strides[0] > 0 and a.strides[1] > 0
    return a if ok else np.ascontiguousarray(a)


def encoder_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int, scale: float,
                      slopes: np.ndarray | None = None, window: int = 0,
                      blocks: np.ndarray | None = None) -> np.ndarray | None:
    """Bidirectional attention over one input's rows q, k, v (n, H*d) float32 in C, as llama.cpp's
    encoder graph computes it (csrc/encoder_attention.c); `slopes`: ALiBi's, one per head; `window`
    > 0: a symmetric sliding window; `blocks` (n): a row sees only its own block's rows (the others
    masked, as a ggml mask does). None on the numpy path."""
    if not _compiled_on:
        return None
    n, width = q.shape
    out = np.empty((n, width), np.float32)
    ran = _C.encoder_attention(np.ascontiguousarray(q, np.float32), np.ascontiguousarray(k, np.float32),
                               np.ascontiguousarray(v, np.float32), out, n, n_head, width // n_head, float(scale),
                               max_threads(), int(window),
                               b"" if slopes is None else np.ascontiguousarray(slopes, np.float32),
                               b"" if blocks is None else np.ascontiguousarray(blocks, np.int32))
    return out if ran else None


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm as ggml_norm computes it, times w plus b (ggml_round.layer_norm's arithmetic)."""
    if not _compiled_on:
        return ggml_round.layer_norm(x, w, b, eps)
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _C.layer_norm(x, np.ascontiguousarray(w, np.float32), np.ascontiguousarray(b, np.float32), out,
                  x.shape[0], x.shape[1], float(eps))
    return out


def gelu(x: np.ndarray, in_place: bool = False) -> np.ndarray:
    """ggml's GELU on float32 (its fp16 table), in C when built; `in_place`: x itself (a product's
    fresh output, contiguous float32) is overwritten instead of a copy."""
    if not _compiled_on:
        return ggml_round.gelu(x)
    if not (in_place and x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable):
        x = np.array(x, np.float32)                # a copy: computed in place
    _C.gelu(x, ggml_round.gelu_table())
    return x


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) of a gate, a new float32 array: in C when built, e^-x by ggml's vector expf
    for every element — what the one-call decode's gates compute (csrc/layer_rows.c)."""
    y = np.array(x, np.float32)
    if not _compiled_on:
        with np.errstate(over="ignore"):                # e^-x = inf: the gate is 0
            return (np.float32(1) / (np.float32(1) + np.exp(-y))).astype(np.float32)
    _C.sigmoid(y)
    return y


def geglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """ggml_geglu_split: gelu(g) * u, the GELU by ggml's fp16 table; g (a product's fresh output)
    is overwritten on the compiled path."""
    if not _compiled_on:
        return ggml_round.geglu(g, u)
    y = gelu(g, in_place=True)
    y *= u
    return y


def kv_store(t: KVType, x: np.ndarray, out: np.ndarray, rot: int = 0) -> None:
    """Write x (..., head_dim) float32 into `out`, t's elements (..., head_dim / block) — as
    llama.cpp writes a cache row of that type, rotated first by `rot` (kv_types.rotation)."""
    if t.block == 1:
        out[...] = x                       # numpy's cast: fp16 rounded to nearest even
        return
    if _C is None:
        out[...] = encode(t, x, rot)
        return
    x = np.ascontiguousarray(x, np.float32)
    d = x.shape[-1]
    if out.flags.c_contiguous:
        _C.kv_store(x, out, t.ggml, x.size // d, d, rot)
    else:
        tmp = np.empty(out.shape, out.dtype)
        _C.kv_store(x, tmp, t.ggml, x.size // d, d, rot)
        out[...] = tmp


def kv_widen(a: np.ndarray, keys: bool = True) -> np.ndarray:
    """A cache's keys (or values) as float32 values, their rotation undone (the numpy reference
    path's copy)."""
    t = kv_type(a.dtype)
    d = a.shape[-1] * t.block
    rot = rotation(t, d, keys)
    if t.block == 1 or _C is None:
        return decode(a, rot)
    out = np.empty((*a.shape[:-1], d), np.float32)
    _C.kv_load(np.ascontiguousarray(a), out, t.ggml, out.size // d, d, rot)
    return out


def compiled_module():
    """The C module when the compiled path is on, else None (blocks.py picks per call)."""
    return _C if _compiled_on else None


def one_call_decode() -> bool:
    """Does the built extension run a decode step's layer in one call (AVX2/FMA), whether the
    compiled path is switched on now or not (native/runners.py checks that per batch)?"""
    return _C is not None and bool(_C.features()["avx2_fma"])


KERNEL_PATH = "compiled" if _compiled_on else "numpy"

# weight type -> how ggml quantizes the activation it is multiplied with
_ACT_QUANT = {Q.Q4_0: "q8_0", Q.Q5_0: "q8_0", Q.Q8_0: "q8_0", Q.IQ4_NL: "q8_0", Q.MXFP4: "q8_0",
              Q.Q4_1: "q8_1", Q.Q5_1: "q8_1",
              Q.Q2_K: "q8_K", Q.Q3_K: "q8_K", Q.Q4_K: "q8_K", Q.Q5_K: "q8_K", Q.Q6_K: "q8_K",
              Q.IQ4_XS: "q8_K", Q.IQ2_XXS: "q8_K", Q.IQ2_XS: "q8_K", Q.IQ2_S: "q8_K",
              Q.IQ3_XXS: "q8_K", Q.IQ3_S: "q8_K", Q.IQ1_S: "q8_K", Q.IQ1_M: "q8_K",
              Q.F16: "f16", Q.BF16: "bf16"}


ACT_MODES = ("ggml", "none")
_act_mode = "ggml"


def set_activation_quantization(mode: str) -> str:
    """"ggml" (default): round activations as llama.cpp does; "none": exact float32.
    Returns the previous mode. KILN_ACT_QUANT sets it at start-up."""
    global _act_mode
    if mode not in ACT_MODES:
        raise ValueError(f"activation quantization {mode!r} is not one of {ACT_MODES}")
    previous, _act_mode = _act_mode, mode
    return previous


def activation_quantization() -> str:
    return _act_mode


def quantize_activations(x: np.ndarray, kind: str | None) -> np.ndarray:
    """x (T, n) float32 rounded as ggml's vec_dot_type `kind` would hold it, back in float32."""
    if kind is None:
        return x
    if kind == "f16":
        return x.astype(np.float16).astype(np.float32)
    if kind == "bf16":
        bits = x.astype(np.float32).view(np.uint32)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000     # round to nearest even
        return bits.view(np.float32)
    block = 256 if kind == "q8_K" else 32
    T, n = x.shape
    if n % block:
        return x
    b = x.reshape(T, n // block, block)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)   # as ggml: 127/amax
    q = np.clip(np.rint(b * inv), -127, 127)             # AVX2 rounds half to even, as rint
    if kind == "q8_K":                                   # ggml stores 1/iscale for Q8_K
        d = np.divide(np.float32(1), inv, out=np.zeros_like(inv), where=inv > 0)
    else:                                                # Q8_0/Q8_1 store d as fp16
        d = d.astype(np.float16).astype(np.float32)
    return (q * d).reshape(T, n)


set_activation_quantization(os.environ.get("KILN_ACT_QUANT", "ggml") or "ggml")


class Weight:
    """A weight matrix (n_out, n_in), or a stack of them (n_expert, n_out, n_in) for MoE.

    `raw` is the stored GGUF blocks (a view into the memory-mapped file, one row of blocks per
    output row); `dense` is a float32 copy, made only when the numpy path needs it."""

    __slots__ = ("name", "qtype", "shape", "raw", "_dense", "_exact")

    def __init__(self, name: str, qtype: Q, shape: tuple, raw: np.ndarray | None = None,
                 dense: np.ndarray | None = None):
        self.name, self.qtype, self.shape, self.raw, self._dense = name, qtype, tuple(shape), raw, dense
        self._exact = None

    @property
    def exact(self):
        """The blocks unpacked for the numpy path's kernel-exact product (ggml_round.prepare)."""
        if self._exact is None:
            n = self.shape[-2] if len(self.shape) > 1 else 1
            self._exact = ggml_round.prepare(self.raw, int(self.qtype), n, self.shape[-1])
        return self._exact

    @property
    def dense(self) -> np.ndarray:
        if self._dense is None:
            self._dense = _dequantize(self.raw, self.qtype, self.shape)
        return self._dense

    @property
    def compiled(self) -> bool:
        return _compiled_on and self.raw is not None and self.qtype in COMPILED_TYPES

    def expert(self, e: int) -> "Weight":
        return Weight(f"{self.name}[{e}]", self.qtype, self.shape[1:],
                      None if self.raw is None else self.raw[e],
                      None if self._dense is None else self._dense[e])

    def row_slice(self, name: str, start: int, stop: int) -> "Weight":
        """Output rows start..stop as a weight of its own (a fused q|k|v matrix split): a view of
        the stored blocks, so its products are the same bits as the whole matrix's rows."""
        return Weight(name, self.qtype, (stop - start, self.shape[-1]),
                      None if self.raw is None else self.raw[start:stop],
                      None if self._dense is None else self._dense[start:stop])

    def rows(self, ids) -> np.ndarray:
        """Rows `ids` as float32 (embedding lookup): only those rows are dequantized."""
        if self._dense is not None or self.raw is None:
            return self.dense[ids]
        return _dequantize(self.raw[ids], self.qtype, (len(ids), self.shape[-1]))

    @property
    def nbytes(self) -> int:
        """Bytes the engine holds for this weight (float32 copy, else the mapped blocks)."""
        return self._dense.nbytes if self._dense is not None else (self.raw.nbytes if self.raw is not None else 0)


def check_type(g: GGUFFile, info: TensorInfo) -> None:
    if info.type not in SUPPORTED_TYPES:
        raise GGUFError(f"{g.path}: tensor {info.name!r} has type {info.type.name}, which Kiln "
                        f"cannot compute with (supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")


def load_vector(g: GGUFFile, name: str) -> np.ndarray:
    info = g.tensor(name)
    check_type(g, info)
    return np.ascontiguousarray(dequantize(g.raw(name), info.type).reshape(info.shape), np.float32)


def load_weights(g: GGUFFile, names: list[str], threads: int = 2) -> dict[str, Weight]:
    """Weights for `names`: on the compiled path, views of the stored blocks (nothing is read
    until used); on the numpy path, float32 copies dequantized in parallel (gguf's numpy code
    releases the GIL in its large array operations)."""
    for n in names:
        check_type(g, g.tensor(n))

    def one(name: str) -> Weight:
        info = g.tensor(name)
        raw = g.raw(name)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        raw = raw.reshape(*info.shape[:-1], info.n_bytes // rows) if len(info.shape) > 1 else raw
        w = Weight(name, info.type, info.shape, raw)
        if not w.compiled and int(info.type) not in ggml_round.EXACT_TYPES:
            w.dense                                   # dequantize now, not on the first request
        return w

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return dict(zip(names, pool.map(one, names)))


def matmul_many(x: np.ndarray, ws: list[Weight]) -> list[np.ndarray]:
    """[matmul(x, w) for w in ws], bit for bit; on the compiled path weights of one type share
    one activation quantization and one parallel loop (a decode step's q/k/v, gate/up)."""
    if len(ws) < 2 or not all(w.compiled and w.qtype == ws[0].qtype and len(w.shape) == 2 for w in ws):
        return [matmul(x, w) for w in ws]
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x.shape
    outs = [np.empty((T, w.shape[0]), np.float32) for w in ws]
    _C.matmul_many(x, int(ws[0].qtype), T, K, [(w.raw, w.shape[0], o) for w, o in zip(ws, outs)], 0)
    return outs


def _dequantize(raw: np.ndarray, qtype: Q, shape: tuple) -> np.ndarray:
    """Stored blocks as float32 of `shape`: gguf-py's values, in C for Q4_0/Q4_1/Q8_0 when built."""
    if _C is not None and qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        out = np.empty(shape, np.float32)
        if _C.dequantize(np.ascontiguousarray(raw), int(qtype), out):
            return out
    return np.ascontiguousarray(dequantize(np.asarray(raw), qtype).reshape(shape), np.float32)


def matmul(x: np.ndarray, w: Weight) -> np.ndarray:
    """x (T, n_in) float32 -> (T, n_out) float32."""
    if w.compiled:
        x = np.ascontiguousarray(x, dtype=np.float32)
        T, K = x.shape
        N = w.shape[-2] if len(w.shape) > 1 else 1
        out = np.empty((T, N), np.float32)
        _C.matmul(x, w.raw, int(w.qtype), T, K, N, out, 0)
        return out
    if _act_mode == "ggml" and w.raw is not None and int(w.qtype) in ggml_round.EXACT_TYPES \
            and x.shape[-1] % 32 == 0:
        # the compiled kernel's arithmetic, in numpy: same bits, so both paths route an MoE alike
        return ggml_round.matmul(x, w.exact)
    kind = _ACT_QUANT.get(w.qtype) if _act_mode == "ggml" else None
    return quantize_activations(x, kind) @ w.dense.T
