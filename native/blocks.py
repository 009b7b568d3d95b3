"""Transformer building blocks shared by every architecture, in float32.

Scalars are made float32 before they touch activations: a numpy float64 scalar would promote
the activations, and then every weight multiply converts the weight to float64 (RESEARCH.md,
NEP 50).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import numpy as np

from . import ggml_round
from .kernels import Weight, attention_compiled, compiled_module, kv_widen, matmul, matmul_many

F32 = np.float32


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis."""
    C = compiled_module()
    if C is not None and x.dtype == np.float32:
        x = np.ascontiguousarray(x)
        n = x.shape[-1]
        out = np.empty_like(x)
        C.rms_norm(x, weight, out, x.size // n, n, eps)
        return out
    # as the kernel (and ggml): float squares summed in order in double, the mean rounded to float
    total = np.cumsum(np.square(x, dtype=F32), axis=-1, dtype=np.float64)[..., -1:]
    ms = (total / x.shape[-1]).astype(F32)
    return x * (F32(1) / np.sqrt(ms + F32(eps))) * weight


_ROPE: dict = {}          # (rope_dim, base, scale, factors) -> (cos, sin) for positions 0..len-1


def yarn_params(rope_dim: int, base: float, scale: float, n_ctx_orig: int, beta_fast: float = 32.0,
                beta_slow: float = 1.0, ext_factor: float = 1.0, attn_factor: float = 1.0) -> tuple:
    """(ext_factor, corr0, corr1, mscale) of ggml's YaRN for a linear `scale` (factor), as
    ggml_rope_yarn_corr_dims and rope_yarn make them (float32, the C library's logf)."""
    libm = _libm()
    logf = (lambda v: F32(libm.logf(float(v)))) if libm else (lambda v: F32(np.log(np.float64(v))))

    def corr_dim(n_rot: float) -> F32:
        return F32(rope_dim) * logf(F32(n_ctx_orig) / (F32(n_rot) * F32(2) * F32(np.pi))) / (F32(2) * logf(F32(base)))
    corr0 = max(F32(0), np.floor(corr_dim(beta_fast)))
    corr1 = min(F32(rope_dim - 1), np.ceil(corr_dim(beta_slow)))
    freq_scale = F32(1) / F32(scale)
    mscale = F32(attn_factor) * F32(np.float64(F32(0.1)) * np.float64(logf(F32(1) / freq_scale)) + 1.0)
    return float(ext_factor), float(corr0), float(corr1), float(mscale)


def rope_tables(positions: np.ndarray, rope_dim: int, base: float, scale: float,
                factors: np.ndarray | None = None, yarn: tuple | None = None):
    """cos/sin of shape (T, rope_dim/2) for the given absolute positions.

    The angles are made as ggml makes them — in float32, each pair's from the previous one
    times powf(base, -2/rope_dim) — not exactly, and their cos/sin by the C library's cosf/sinf:
    a position's angles then carry ggml's rounding, and llama.cpp's outputs are what the engine
    is held to. `factors` (Llama 3's rope_freqs: one per pair) divide each pair's angle before
    the linear scale, as ggml's rope cache does. Made once per position (a table that grows in
    chunks), so a decode step only indexes it."""
    positions = np.asarray(positions, dtype=np.int64)
    half = rope_dim // 2
    ff = np.ones(half, F32) if factors is None else np.ascontiguousarray(factors, F32)
    if ff.shape != (half,):
        raise ValueError(f"rope factors: {ff.shape[0]} values for {half} rotated pairs")
    key = (rope_dim, float(base), float(scale), ff.tobytes(), yarn)
    cos, sin = _ROPE.get(key, (np.empty((0, half), F32),) * 2)
    need = int(positions.max(initial=-1)) + 1
    if need > len(cos):
        n = max(need, 2 * len(cos), 1024)
        cos, sin = _rope_table(n, half, float(base), 1.0 / scale, ff, yarn)
        _ROPE[key] = (cos, sin)
    return cos[positions], sin[positions]


def rope_shift_table(delta: int, rope_dim: int, base: float, scale: float,
                     factors: np.ndarray | None = None, yarn: tuple | None = None):
    """cos/sin (1, rope_dim/2) of the angle `delta` positions make — a context shift turns every
    kept key by it (native/kv_cache.py shift), as llama.cpp's K-shift ropes its keys with the
    position delta: the same rope cache, made from position `delta` instead of a position."""
    half = rope_dim // 2
    ff = np.ones(half, F32) if factors is None else np.ascontiguousarray(factors, F32)
    return _rope_table(1, half, float(base), 1.0 / scale, ff, yarn, p0=delta)


def _rope_table(n: int, half: int, base: float, freq_scale: float,
                factors: np.ndarray, yarn: tuple | None = None, p0: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) (n, half) float32 of positions p0.. as ggml's rope cache: compiled, else libm
    through ctypes, else numpy in float64 (which differs from glibc's cosf in ~2 % of entries by an ulp)."""
    cos, sin = np.empty((n, half), F32), np.empty((n, half), F32)
    C = compiled_module()
    if C is not None:
        C.rope_table(n, half, base, freq_scale, factors, cos, sin, *(yarn or (0.0, 0.0, 0.0, 1.0)), p0)
        return cos, sin
    libm = _libm()
    theta_scale = F32(libm.powf(base, -2.0 / (2 * half))) if libm else F32(base ** (-2.0 / (2 * half)))
    theta = np.arange(p0, p0 + n).astype(F32)
    angles = np.empty((n, half), F32)
    ext, c0, c1, mscale = yarn or (0.0, 0.0, 0.0, 1.0)
    for i in range(half):
        extrap = theta / factors[i]                                  # theta / 1.0f is exact
        angles[:, i] = F32(freq_scale) * extrap
        if ext:                                                      # YaRN's ramp, fused as gcc fuses it
            y = (F32(i) - F32(c0)) / max(F32(0.001), F32(c1) - F32(c0))
            ramp = (F32(1) - min(F32(1), max(F32(0), y))) * F32(ext)
            angles[:, i] = (angles[:, i].astype(np.float64) * np.float64(F32(1) - ramp)
                            + (extrap * ramp).astype(np.float64)).astype(F32)
        theta = theta * theta_scale
    if libm:
        flat = angles.ravel()
        cos.ravel()[:] = [libm.cosf(a) for a in flat]
        sin.ravel()[:] = [libm.sinf(a) for a in flat]
    else:
        cos[:], sin[:] = np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))
    if mscale != 1.0:
        cos *= F32(mscale)
        sin *= F32(mscale)
    return cos, sin


@functools.lru_cache(maxsize=1)
def _libm():
    """The C library's float cosf/sinf/powf (those llama.cpp calls), or None."""
    path = ctypes.util.find_library("m")
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for name, nargs in (("cosf", 1), ("sinf", 1), ("powf", 2), ("logf", 1)):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float] * nargs
    return lib


def _fma_minus(a, b, c, d) -> np.ndarray:
    """float32 fma(a, b, -(c*d)): a*b is exact in float64; the rounding to float64 before float32
    can differ from one fused rounding only on a 2^-29-rare tie."""
    return (a.astype(np.float64) * b - (c * d)).astype(F32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate x (T, H, d) in place over its first rope_dim dimensions.

    "normal" (llama): pairs are adjacent dims (2i, 2i+1) — the GGUF converter permuted Q/K so.
    "neox" (qwen, olmoe): pairs are (i, i + rope_dim/2), i.e. rotate-half.
    """
    half = cos.shape[1]
    C = compiled_module()
    if C is not None and x.flags.c_contiguous and x.dtype == np.float32:
        T, H, D = x.shape
        C.rope(x, cos, sin, T, H, D, 2 * half, style != "normal")
        return x
    c, s = cos[:, None, :], sin[:, None, :]
    # as ggml: the first product fused with the difference (sum) of the second, rounded first
    lo, hi = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if style == "normal" else \
        (slice(0, half), slice(half, 2 * half))
    a, b = x[..., lo].copy(), x[..., hi].copy()
    x[..., lo] = _fma_minus(a, c, b, s)
    x[..., hi] = _fma_minus(a, s, -b, c)
    return x


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float | None = None,
              window: int = 0, sinks: np.ndarray | None = None, see: np.ndarray | None = None) -> np.ndarray:
    """Causal multi-head attention with grouped KV heads.

    q (T, H, d) for positions start..start+T-1; k, v (S, Hkv, d) for positions 0..S-1 with
    S = start + T. Query head h reads KV head h // (H / Hkv), as ggml broadcasts. `scale`
    multiplies the scores (default 1/sqrt(d)); `window` > 0 lets a query see only itself and the
    window - 1 positions before it (sliding-window layers); `sinks` (H): a logit per head that
    joins each softmax's denominator (gpt-oss); `see` (T): the last key each row sees, past its
    own position (the rows of an image that attend to the whole image: Gemma 3's). Returns (T, H*d).
    """
    compiled = None if see is not None else attention_compiled(q, k, v, start, scale, window, sinks)
    if compiled is not None:
        return compiled
    if k.dtype.fields is not None or v.dtype.fields is not None:
        k, v = kv_widen(k), kv_widen(v, keys=False)     # a quantized cache: its values, as float32
    elif k.dtype == np.float16:                 # the compiled kernel's (and ggml's) rounding
        return ggml_round.attention_f16(q, k, v, start, scale, window, sinks, see)
    T, H, d = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    k, v = k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)    # a float32 cache
    qg = q.reshape(T, Hkv, G, d).transpose(1, 2, 0, 3)               # (Hkv, G, T, d)
    scores = np.matmul(qg, k.transpose(1, 2, 0)[:, None])            # (Hkv, G, T, S)
    scores *= F32(scale) if scale else F32(1.0 / np.sqrt(d))
    if T > 1 or window or see is not None:
        # query i sits at position start + i and may see keys 0..start+i (or 0..see[i])
        last = (start + np.arange(T))[:, None] if see is None else np.asarray(see)[:, None]
        mask = np.arange(S)[None, :] > last
        if window:
            mask |= np.arange(S)[None, :] <= (start + np.arange(T))[:, None] - window
        scores[..., mask] = -np.inf
    mx = scores.max(axis=-1, keepdims=True)
    if sinks is not None:                                            # (Hkv, G) per head
        sk = np.asarray(sinks, F32).reshape(Hkv, G)[:, :, None, None]
        mx = np.maximum(mx, sk)
    scores -= mx
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sk - mx)
    scores *= F32(1.0) / denom
    out = np.matmul(scores, v.transpose(1, 0, 2)[:, None])           # (Hkv, G, T, d)
    return out.transpose(2, 0, 1, 3).reshape(T, H * d)


def swiglu_ffn(x: np.ndarray, gate: Weight, up: Weight, down: Weight, mm=matmul) -> np.ndarray:
    """down(silu(gate x) * up x); `mm` multiplies by a weight (a LoRA-adding one, say)."""
    C = compiled_module()
    if C is not None:
        if mm is matmul:
            g, u = matmul_many(x, [gate, up])
        else:
            g, u = mm(x, gate), mm(x, up)
        C.swiglu(g, u)
        return mm(g, down)
    return mm(ggml_round.silu(mm(x, gate)) * mm(x, up), down)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def route(x: np.ndarray, router: Weight, k: int, normalize: bool, rule: tuple | None = None, by_numpy=None):
    """Mixture-of-experts routing: softmax over all experts, top-k, optional renormalisation —
    or `rule`, csrc/layer.h's RouteRule as a tuple (ernie4.5-moe's and deepseek2's selection
    bias, sigmoid gating, groups, scale), with `by_numpy(logits)` its numpy form.

    Returns (experts (T, k) int, weights (T, k) float32). On the compiled path the one-call
    decode's routing (C) serves here too, so both paths choose and weigh experts bit for bit
    alike; its experts come in ascending order."""
    logits = matmul(x, router)                                          # (T, E)
    C = compiled_module()
    if C is not None and 1 <= k <= logits.shape[1] <= 256:
        T, E = logits.shape
        experts, weights = np.empty((T, k), np.int32), np.empty((T, k), F32)
        C.route(logits, T, E, k, normalize, experts, weights, rule)
        return experts, weights
    if by_numpy is not None:
        return by_numpy(logits)
    probs = ggml_round.softmax(logits)                                  # as the C routing
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, top, axis=-1)
    if normalize:
        w = w / np.cumsum(w, axis=-1, dtype=np.float64)[:, -1:].astype(F32)
    return top, w.astype(F32)


def moe_ffn(x: np.ndarray, experts: np.ndarray, weights: np.ndarray, expert_ffn) -> np.ndarray:
    """Sum over each token's selected experts of weight * expert_ffn(e, x_subset).

    expert_ffn(e, xs) computes expert e's FFN for the rows xs; the stream worker supplies one
    that fetches the expert's weights from its cache."""
    out = np.zeros_like(x)
    if x.shape[0] == 1:             # a decode row: the same operations, without the bookkeeping
        for slot in np.argsort(experts[0], kind="stable"):               # ascending expert, as below
            out[0:1] += weights[0:1, slot, None] * expert_ffn(int(experts[0, slot]), x[0:1])
        return out
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)
        out[rows] += weights[rows, slot, None] * expert_ffn(int(e), x[rows])
    return out
