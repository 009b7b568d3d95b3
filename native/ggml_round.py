"""ggml's rounding on the numpy path: its AVX2 exp, its softmax sums, its attention sum orders.

The compiled kernels (csrc/) compute these as llama.cpp's CPU graph does, because an MoE whose
routing turns on 1e-4 probability gaps re-routes on any other rounding (tests/data/README.md).
This is the same arithmetic in numpy, operation for operation, so the numpy path
(KILN_NATIVE_KERNELS=0) rounds alike: float32 throughout, FMAs through float64 (a float32
product is exact there; the sum then rounds twice only in rare exact-halfway cases).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def _fma(a, b, c) -> np.ndarray:
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F32)


_C1, _C2, _C3, _C4, _C5 = (F32(float.fromhex(h)) for h in
                           ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1"))
_R, _LOG2E = F32(float.fromhex("0x1.8p23")), F32(float.fromhex("0x1.715476p+0"))
_LN2_HI, _LN2_LO = F32(float.fromhex("0x1.62e4p-1")), F32(float.fromhex("0x1.7f7d1cp-20"))


def expf(x: np.ndarray) -> np.ndarray:
    """exp as ggml's AVX2 ggml_v_expf (csrc/kiln.h expf8), elementwise; -inf gives 0."""
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        z = _fma(x, _LOG2E, _R)
        n = z - _R
        b = _fma(-n, _LN2_LO, _fma(-n, _LN2_HI, x))
        e = (z.view(np.uint32) << np.uint32(23))
        k = (e + np.array(1, F32).view(np.uint32)).view(F32)
        u = b * b
        j = _fma(_fma(_fma(_C1, b, _C2), u, _fma(_C3, b, _C4)), u, _C5 * b)
        plain = _fma(j, k, k)
        c = np.abs(n) > F32(126)
        if not c.any():
            return plain
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0))
        s1 = (g + np.uint32(0x7F000000)).view(F32)
        s2 = (e - g).view(F32)
        big = _fma(s2, j, s2) * s1
        return np.where(np.abs(n) > F32(192), s1 * s1, np.where(c, big, plain)).astype(F32)


def hsum8(x: np.ndarray) -> np.ndarray:
    """The last axis (8) summed as an AVX 8-lane horizontal sum: ((0+4)+(2+6))+((1+5)+(3+7))."""
    return ((x[..., 0] + x[..., 4]) + (x[..., 2] + x[..., 6])) + ((x[..., 1] + x[..., 5]) + (x[..., 3] + x[..., 7]))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """ggml_norm as its AVX2 build computes it, times w plus b: the mean from a double sum rounded
    to float and divided in float; the variance from float squares summed 8 at a time in
    ggml_vec_cvar_f32's lane order (then in double); one float scale."""
    n = x.shape[-1]
    mean = (x.astype(np.float64).sum(axis=-1, keepdims=True).astype(F32) / F32(n)).astype(F32)
    y = (x - mean).astype(F32)
    sq = y * y
    full = n - n % 8
    lanes = sq[..., :full].reshape(*sq.shape[:-1], full // 8, 8)
    a = lanes[..., 4:] + lanes[..., :4]                       # the high half plus the low half
    chunk = (a[..., 0] + a[..., 2]) + (a[..., 1] + a[..., 3])
    total = chunk.astype(np.float64).sum(axis=-1, keepdims=True) + \
        sq[..., full:].astype(np.float64).sum(axis=-1, keepdims=True)
    var = (total / n).astype(F32)
    scale = F32(1) / np.sqrt(var + F32(eps))
    return (y * scale) * w + b


def vec_dot_f32(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Each row of w (N, K) dotted with x (K,) as ggml_vec_dot_f32 (AVX2) does — what a product
    of F32 weights with one activation row runs (tinyBLAS takes two or more): four 8-lane FMA
    accumulators over 32 at a time, reduced as ((a0+a2)+(a1+a3)), the 8 lanes as
    ((0+4)+(1+5))+((2+6)+(3+7)), then the tail multiplied and added in order."""
    N, K = w.shape
    full = K - K % 32
    acc = np.zeros((N, 4, 8), F32)
    for i in range(0, full, 32):
        acc = _fma(w[:, i:i + 32].reshape(N, 4, 8), x[i:i + 32].reshape(4, 8), acc)
    s = (acc[:, 0] + acc[:, 2]) + (acc[:, 1] + acc[:, 3])
    t = s[:, :4] + s[:, 4:]
    r = (t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3])
    for i in range(full, K):
        r = r + w[:, i] * x[i]
    return r.astype(F32)


def vec_dot_f32_rows(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """vec_dot_f32 of every row of x (T, K) with every row of w (N, K): (T, N) — what ggml's
    mul_mat runs for F32 weights when the activations are not contiguous (a permuted view:
    tinyBLAS is not tried). The tail past the last 32 is multiplied, then added (not fused:
    tested against llama.cpp on a 16-wide product, where the tail is everything)."""
    T, K = x.shape
    N = w.shape[0]
    full = K - K % 32
    acc = np.zeros((T, N, 4, 8), F32)
    for i in range(0, full, 32):
        acc = _fma(w[None, :, i:i + 32].reshape(1, N, 4, 8), x[:, None, i:i + 32].reshape(T, 1, 4, 8), acc)
    s = (acc[:, :, 0] + acc[:, :, 2]) + (acc[:, :, 1] + acc[:, :, 3])
    t = s[..., :4] + s[..., 4:]
    r = (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])
    for i in range(full, K):
        r = (r + w[None, :, i] * x[:, None, i]).astype(F32)
    return r.astype(F32)


def libm_tanhf(x: np.ndarray) -> np.ndarray:
    """The C library's tanhf, element by element (ggml_tanh's)."""
    import ctypes
    import ctypes.util
    lib = ctypes.CDLL(ctypes.util.find_library("m"))
    lib.tanhf.restype, lib.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.array([lib.tanhf(float(v)) for v in np.ravel(x)], F32).reshape(np.shape(x))


def lane_sums(x: np.ndarray) -> np.ndarray:
    """Sum over the last axis as an 8-lane SIMD loop does: lane i adds elements i, i+8, ... in
    order (from zero; the axis is zero-padded to a multiple of 8), then hsum8."""
    n = x.shape[-1]
    pad = -n % 8
    if pad:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), x.dtype)], axis=-1)
    lanes = x.reshape(x.shape[:-1] + (-1, 8))
    return hsum8(np.cumsum(lanes, axis=-2, dtype=F32)[..., -1, :])


def softmax(x: np.ndarray, sink: np.ndarray | None = None) -> np.ndarray:
    """Over the last axis as ggml's soft_max: max, expf, each 8's sum added in double, times a
    float32 1/sum made in double. -inf entries (masked) give 0. `sink` (x.shape[:-1]): a logit
    that joins the max and the denominator but has no output (gpt-oss's attention sinks), its
    exponential by the C library's expf, as ggml's."""
    x = np.asarray(x, F32)
    mx = x.max(axis=-1, keepdims=True)
    if sink is not None:
        mx = np.maximum(mx, np.asarray(sink, F32)[..., None])
    e = expf(x - mx)
    n = e.shape[-1]
    pad = -n % 8
    padded = np.concatenate([e, np.zeros(e.shape[:-1] + (pad,), F32)], axis=-1) if pad else e
    chunks = hsum8(padded.reshape(padded.shape[:-1] + (-1, 8))).astype(np.float64)
    total = np.cumsum(chunks, axis=-1)[..., -1:]
    if sink is not None:
        total = total + libm_expf(np.broadcast_to(np.asarray(sink, F32)[..., None], mx.shape) - mx).astype(np.float64)
    return e * (1.0 / total).astype(F32)


def libm_expf(x: np.ndarray) -> np.ndarray:
    """The C library's expf, element by element (what ggml's scalar code calls)."""
    import ctypes
    import ctypes.util
    global _EXPF
    if _EXPF is None:
        lib = ctypes.CDLL(ctypes.util.find_library("m"))
        lib.expf.restype, lib.expf.argtypes = ctypes.c_float, [ctypes.c_float]
        _EXPF = lib.expf
    x = np.array(x, F32)                        # a copy: computed in place
    try:
        from . import _kernels as _C            # the compiled loop when built (same libm expf)
    except ImportError:
        _C = None
    if _C is not None:
        _C.expf(x)
        return x
    return np.array([_EXPF(float(v)) for v in x.ravel()], F32).reshape(x.shape)


_EXPF = None


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, F32)
    return x / (F32(1) + expf(F32(0) - x))


def attention_f16(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, kq_scale: float | None = None,
                  window: int = 0, sinks: np.ndarray | None = None, see: np.ndarray | None = None) -> np.ndarray:
    """Causal attention over an fp16 cache as the compiled task computes it (csrc/attention.c):
    q rounded to fp16; each score an 8-lane sum over the head dimension, times 1/sqrt(d); ggml's
    softmax; probabilities rounded to fp16; each output an 8-lane sum over the positions.
    fp16 x fp16 products are exact in float32, so these sums are the FMAs' bits. `see` (T): the
    last key each row sees when it is not its own position (an image's rows seeing the whole image)."""
    T, H, d = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    q = q.astype(np.float16).astype(F32)
    k, v = k.astype(F32), v.astype(F32)
    scale = F32(kq_scale) if kq_scale else F32(1) / np.sqrt(F32(d))
    out = np.empty((T, H, d), F32)
    step = max(1, (1 << 22) // max(1, S * H * d))            # rows per block: bounded temporaries
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        qg = q[t0:t1].reshape(t1 - t0, Hkv, G, d)
        prod = qg[:, :, :, None, :] * k.transpose(1, 0, 2)[None, :, None, :, :]   # (t, Hkv, G, S, d)
        scores = lane_sums(prod) * scale                                      # (t, Hkv, G, S)
        pos = (start + np.arange(t0, t1))[:, None]
        last = pos if see is None else np.asarray(see)[t0:t1, None]
        mask = np.arange(S)[None, :] > last                                   # (t, S)
        if window:                                                            # sliding window
            mask |= np.arange(S)[None, :] <= pos - window
        scores[np.broadcast_to(mask[:, None, None, :], scores.shape)] = -np.inf
        sk = None if sinks is None else np.broadcast_to(np.asarray(sinks, F32).reshape(Hkv, G)[None],
                                                        scores.shape[:-1])
        p = softmax(scores, sk).astype(np.float16).astype(F32)
        vt = v.transpose(1, 2, 0)                                             # (Hkv, d, S)
        prod = p[:, :, :, None, :] * vt[None, :, None, :, :]                  # (t, Hkv, G, d, S)
        out[t0:t1] = lane_sums(prod).reshape(t1 - t0, H, d)
    return out.reshape(T, H * d)


# -- quantized matrix products ---------------------------------------------------------------
# The compiled kernels' AVX2 dot products (csrc/quant.c), in numpy: activations quantized per
# block of 32 as they are there, each block's integer products summed in 8 lanes of 4 elements,
# every block added to its lane by an FMA with the two scales' product, the lanes reduced by
# hsum8 (Q4_1 adds its min term after). These are ggml's vec_dot_q4_0/q4_1/q8_0 for AVX2.

EXACT_TYPES = {2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 0: "f32"}   # ggml type ids
_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}
_ELEMENTS = 1 << 24                                           # bound on a temporary's elements


def _fp16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, F32).astype(np.float16).astype(F32)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (T, K) -> q (T, K/32, 32) int values as float32, d (T, K/32) fp16-rounded, s (T, K/32)
    = fp16(d_unrounded * sum q) — as csrc/quant.c quantize_row (and ggml's quantize_row_q8_1)."""
    T, K = x.shape
    b = np.asarray(x, F32).reshape(T, K // 32, 32)
    amax = np.abs(b).max(axis=-1)
    dd = amax / F32(127)
    inv = np.divide(F32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(F32)
    return q, _fp16(dd), _fp16(dd * q.sum(axis=-1, dtype=np.int32).astype(F32))


def _unpack(raw: np.ndarray, kind: str, N: int, nb: int):
    """Weight blocks (N, nb*bytes) -> values (N, nb, 32) float32, d (N, nb), m (N, nb) or None."""
    blk = np.asarray(raw).reshape(N, nb, _BLOCK_BYTES[kind])
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    if kind == "q8_0":
        return blk[..., 2:].view(np.int8).astype(F32), d, None
    qs = blk[..., -16:]
    vals = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(F32)
    if kind in ("q5_0", "q5_1"):                              # the fifth bit of value j: bit j of qh
        qh = blk[..., -20:-16].copy().view("<u4")[..., 0]
        vals = vals + ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(F32) * F32(16)
    if kind == "q4_0":
        return vals - F32(8), d, None
    if kind == "q5_0":
        return vals - F32(16), d, None
    return vals, d, blk[..., 2:4].copy().view(np.float16)[..., 0].astype(F32)


def prepare(raw: np.ndarray, qtype: int, N: int, K: int):
    """A weight's blocks unpacked once for `matmul`: the values laid out (blocks, lane, 4, N) for
    the lane products, the scales (blocks, N) — float32, as much memory as a dequantized copy."""
    kind = EXACT_TYPES[int(qtype)]
    if kind == "f32":
        return kind, np.asarray(raw).reshape(N, -1).view(F32)[:, :K], None, None
    nb = K // 32
    w, dw, mw = _unpack(raw, kind, N, nb)
    wl = np.ascontiguousarray(w.reshape(N, nb, 8, 4).transpose(1, 2, 3, 0))
    return kind, wl, np.ascontiguousarray(dw.T), None if mw is None else np.ascontiguousarray(mw.T)


def matmul(x: np.ndarray, prepared) -> np.ndarray:
    """x (T, K) float32 times a prepared weight, as the AVX2 kernel computes it."""
    kind, wl, dw, mw = prepared
    x = np.asarray(x, F32)
    if kind == "f32":
        return _matmul_f32(x, wl)
    T, K = x.shape
    nb, N = K // 32, wl.shape[-1]
    q, dx, sx = quantize_q8(x)
    out = np.empty((T, N), F32)
    rows = max(1, _ELEMENTS // max(1, N * nb * 8))
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        ql = q[t0:t1].reshape(t1 - t0, nb, 8, 4).transpose(1, 2, 0, 3)  # (nb, 8, t, 4)
        partial = np.matmul(ql, wl)                                      # (nb, 8, t, N): exact integers
        acc = np.zeros((8, t1 - t0, N), F32)
        for b in range(nb):
            scale = (dx[t0:t1, b, None] * dw[b][None, :]).astype(np.float64)          # (t, N)
            acc = (scale * partial[b] + acc).astype(F32)                 # the FMA, exactly rounded
        res = hsum8(acc.transpose(1, 2, 0))
        if mw is not None:
            m = np.zeros((t1 - t0, N), F32)
            for b in range(nb):
                m = m + sx[t0:t1, b, None] * mw[b][None, :]
            res = res + m
        out[t0:t1] = res
    return out


def _matmul_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """F32 weights: 8 lanes of FMAs over the row, hsum8, then the tail in order."""
    T, K = x.shape
    N = w.shape[0]
    k8 = K - K % 8
    out = np.empty((T, N), F32)
    rows = max(1, _ELEMENTS // max(1, N * 8))
    wl = w[:, :k8].reshape(N, -1, 8).astype(np.float64)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        xl = x[t0:t1, :k8].reshape(t1 - t0, -1, 8).astype(np.float64)
        acc = np.zeros((t1 - t0, N, 8), F32)
        for i in range(k8 // 8):
            acc = (xl[:, None, i, :] * wl[None, :, i, :] + acc).astype(F32)
        r = hsum8(acc)
        for i in range(k8, K):
            r = r + x[t0:t1, i, None] * w[None, :, i]
        out[t0:t1] = r
    return out


# -- GELU as ggml computes it (GGML_GELU_FP16) ---------------------------------------------------
# ggml's f32 GELU (and GEGLU) do not evaluate the formula: the input is rounded to fp16 and looked
# up in a 65 536-entry table of fp16 results, made once with the C library's tanhf; inputs at or
# below -10 give 0 and at or above 10 pass through.
_GELU: dict = {}


def gelu_table(fused: bool = True) -> np.ndarray:
    """The fp16 results (as float32) for every fp16 bit pattern: 0.5x(1 + tanh(√(2/π)·x·(1 +
    0.044715x²))) in float32, `1 + a·x·x` fused as gcc -march=native compiles it."""
    if fused not in _GELU:
        import ctypes
        import ctypes.util
        libm = ctypes.CDLL(ctypes.util.find_library("m"))
        libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)
        with np.errstate(invalid="ignore", over="ignore"):       # the NaN and inf patterns
            ax = F32(0.044715) * x
            inner = (ax.astype(np.float64) * x + 1.0).astype(F32) if fused else F32(1) + ax * x
            arg = F32(0.79788456080286535587989211986876) * x * inner
            t = np.array([libm.tanhf(float(a)) for a in arg], F32)
            y = F32(0.5) * x * (F32(1) + t)
            _GELU[fused] = y.astype(np.float16).astype(F32)
    return _GELU[fused]


def gelu(x: np.ndarray) -> np.ndarray:
    """ggml_gelu on float32: the fp16 table between -10 and 10, 0 below, x above."""
    y = gelu_table()[x.astype(np.float16).view(np.uint16)]
    y = np.where(x <= F32(-10), F32(0), y)
    return np.where(x >= F32(10), x, y).astype(F32)


def geglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """ggml_geglu_split: gelu(g) * u, gelu by the fp16 table."""
    table = gelu_table()
    idx = g.astype(np.float16).view(np.uint16)
    y = table[idx] * u
    y = np.where(g <= F32(-10), F32(0), y)
    return np.where(g >= F32(10), g * u, y).astype(F32)
