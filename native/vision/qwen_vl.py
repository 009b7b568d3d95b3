"""Qwen2.5-VL's and Qwen3-VL's vision towers as llama.cpp's mtmd runs them (tools/mtmd/models/
qwen2vl.cpp, qwen3vl.cpp, clip.cpp's inputs): an image of its own size (images.py rounds it to
whole 2×2 patches) becomes one text row per 2×2 patches.

    x = patches · patch_embd + patches · patch_embd.1        (the temporal pair of a still image)
    patches in merge order: 2×2 blocks row by row, each block's four patches together
    windows: the blocks regrouped window by window (112 pixels a side), every layer but each
             wa_pattern-th attending within its window only (a mask over all the patches)
    per layer:  x += out(attn(rope2d(RMS1(x))));  x += down(silu(gate(RMS2 x)) * up(RMS2 x))
    x = post RMS(x); each block's four patches one row · mm.0, GELU, · mm.2; back in block order

Qwen3-VL differs: a patch bias and learned position embeddings (a square table stretched
bilinearly to the image's patches, resample.py), LayerNorms, one fused qkv, a GELU FFN, no windows;
after each deepstack layer its output, 2×2 blocks normed and through their own MLP, becomes
another slice of each text row (the text model adds it after its own first layers).

The 2D rope turns a head's first quarter pairs by the patch's row and the second by its column
(ggml's vision rope: pairs (i, i + d/2), angles base 10000 over d/2 dimensions)."""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..blocks import apply_rope, rms_norm, rope_tables
from ..ggml_round import silu
from ..kernels import matmul, matmul_many
from .attention import patch_attention
from .clip_config import QWEN3VL
from .resample import bilinear_aligned

F32 = np.float32
WINDOW_PIXELS = 112          # mtmd's attn_window_size when the file names none


def merge_order(py: int, px: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch in merge order: blocks of 2×2 row by row, within a block
    (0,0) (0,1) (1,0) (1,1) — how clip.cpp lays the convolution's output out."""
    y, x = np.mgrid[0:py:2, 0:px:2]
    dy, dx = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
    return (y.reshape(-1, 1) + dy).reshape(-1), (x.reshape(-1, 1) + dx).reshape(-1)


def windows(ph: int, pw: int, side: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The blocks (of a ph × pw grid) regrouped window by window, `side` blocks a window's side:
    the block at each new place, and each window's (first, end) in the new order."""
    order, bounds = [], []
    for y in range(0, ph, side):
        for x in range(0, pw, side):
            first = len(order)
            order += [(y + dy) * pw + x + dx for dy in range(min(side, ph - y)) for dx in range(min(side, pw - x))]
            bounds.append((first, len(order)))
    return np.asarray(order, np.int64), bounds


def encode(enc, image: np.ndarray) -> np.ndarray:
    """(rows, n_text): the text rows of one (3, h, w) image, row by row of 2×2 blocks."""
    c, w, v = enc.config, enc.w, enc.v
    p = c.patch_size
    _, H, W = image.shape
    if H % (2 * p) or W % (2 * p) or not H or not W:
        raise ValueError(f"an image must be whole 2×2 patches of {p} pixels, not {W}×{H}")
    py, px = H // p, W // p
    ys, xs = merge_order(py, px)
    order, bounds = windows(py // 2, px // 2, max(1, WINDOW_PIXELS // p // 2)) if c.wa_pattern else (None, None)
    if order is not None:          # the patches window by window: each block's four stay together
        rows = (order[:, None] * 4 + np.arange(4)).reshape(-1)
        ys, xs = ys[rows], xs[rows]
        # each patch's window: the others masked over the whole image, as mtmd's window_mask
        window_of = np.repeat(np.concatenate([np.full(e - a, w) for w, (a, e) in enumerate(bounds)]), 4)
    # im2col: each patch's channels, then rows, then columns — the kernel's (3, p, p) order
    cols = image.reshape(3, py, p, px, p).transpose(1, 3, 0, 2, 4)[ys, xs].reshape(len(ys), 3 * p * p)
    cols = np.ascontiguousarray(cols, F32)
    x = matmul(cols, enc.patch) + matmul(cols, enc.patch1)
    qwen3 = c.projector == QWEN3VL
    if qwen3:
        x += v["v.patch_embd.bias"]
        table = v["v.position_embd.weight"]
        side = int(round(np.sqrt(len(table))))
        grid = table.reshape(side, side, -1)
        if (px, py) != (side, side):
            grid = bilinear_aligned(grid, px, py)
        x += grid[ys, xs]
    x = _norm(x, v, "v.pre_ln", c.eps, qwen3)
    H_, d = c.n_head, c.head_dim
    cy, sy = rope_tables(ys, d // 2, 10000.0, 1.0)
    cx, sx = rope_tables(xs, d // 2, 10000.0, 1.0)
    cos, sin = np.concatenate([cy, cx], 1), np.concatenate([sy, sx], 1)
    scale = F32(1) / np.sqrt(F32(d))
    n = len(ys)
    deep = []
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        h = _norm(x, v, b + "ln1", c.eps, qwen3)
        if qwen3:
            qkv = matmul(h, w[b + "attn_qkv.weight"]) + v[b + "attn_qkv.bias"]
            q, k, val = (np.ascontiguousarray(qkv[:, j * c.n_embd:(j + 1) * c.n_embd]) for j in range(3))
        else:
            q, k, val = (m + v[b + t + ".bias"] for m, t in zip(
                matmul_many(h, [w[b + t + ".weight"] for t in ("attn_q", "attn_k", "attn_v")]),
                ("attn_q", "attn_k", "attn_v")))
        q = apply_rope(np.ascontiguousarray(q.reshape(n, H_, d)), cos, sin, "neox").reshape(n, -1)
        k = apply_rope(np.ascontiguousarray(k.reshape(n, H_, d)), cos, sin, "neox").reshape(n, -1)
        full = order is None or (i + 1) % c.wa_pattern == 0
        a = patch_attention(q, k, val, H_, scale, None if full else window_of)
        x = _bias(matmul(a, w[b + "attn_out.weight"]), v, b + "attn_out.bias") + x
        h = _norm(x, v, b + "ln2", c.eps, qwen3)
        if qwen3:
            g = kernels.gelu(_bias(matmul(h, w[b + enc.up + ".weight"]), v, b + enc.up + ".bias"), in_place=True)
        else:
            g, u = matmul_many(h, [w[b + "ffn_gate.weight"], w[b + enc.up + ".weight"]])
            g, u = _bias(g, v, b + "ffn_gate.bias"), _bias(u, v, b + enc.up + ".bias")
            C = kernels.compiled_module()
            if C is not None:
                C.swiglu(g, u)
            else:
                g = silu(g) * u
        x = x + _bias(matmul(g, w[b + enc.down + ".weight"]), v, b + enc.down + ".bias")
        if i in c.deepstack:           # this layer's output also goes to the text model, by its own merger
            ds = f"v.deepstack.{i}."
            block = _norm(np.ascontiguousarray(x.reshape(n // 4, 4 * c.n_embd)), v, ds + "norm", c.eps, True)
            deep.append(_merge(block, w, v, ds + "fc1", ds + "fc2"))
    x = _norm(x, v, "v.post_ln", c.eps, qwen3)
    out = _merge(np.ascontiguousarray(x.reshape(n // 4, 4 * c.n_embd)), w, v, "mm.0", "mm.2")
    if deep:
        out = np.concatenate([out, *deep], 1)
    if order is not None:
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        out = out[back]
    return np.ascontiguousarray(out, F32)


def _bias(x: np.ndarray, v: dict, name: str) -> np.ndarray:
    b = v.get(name)
    if b is not None:
        x += b
    return x


def _merge(x: np.ndarray, w: dict, v: dict, fc1: str, fc2: str) -> np.ndarray:
    """A merger's MLP: fc1 + bias, GELU, fc2 + bias."""
    hidden = kernels.gelu(matmul(x, w[fc1 + ".weight"]) + v[fc1 + ".bias"], in_place=True)
    return matmul(hidden, w[fc2 + ".weight"]) + v[fc2 + ".bias"]


def _norm(x: np.ndarray, v: dict, name: str, eps: float, layer: bool = False) -> np.ndarray:
    """RMS norm (`layer`: LayerNorm) × weight (+ bias), as clip.cpp's build_norm; x itself
    without that norm."""
    if name + ".weight" not in v:
        return x
    if layer:
        wt = v[name + ".weight"]
        return kernels.layer_norm(x, wt, v.get(name + ".bias", np.zeros_like(wt)), eps)
    return _bias(rms_norm(x, v[name + ".weight"], eps), v, name + ".bias")

