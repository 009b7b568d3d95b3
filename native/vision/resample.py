"""ggml's bilinear resize with aligned corners (ggml_interpolate, GGML_SCALE_MODE_BILINEAR |
GGML_SCALE_FLAG_ALIGN_CORNERS, its CPU loop in float32) — how clip.cpp stretches a table of
learned position embeddings to an image's patches (Qwen3-VL)."""

from __future__ import annotations

import numpy as np

F32 = np.float32


def _taps(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, second, fraction) of each output index along one axis, as ggml computes them."""
    sf = F32(n_out - 1) / F32(n_in - 1) if n_out > 1 and n_in > 1 else F32(n_out) / F32(n_in)
    at = (np.arange(n_out, dtype=F32) / sf).astype(F32)              # (i + 0) / sf - 0
    lo = np.floor(at).astype(np.int64)
    hi = lo + 1
    lo, hi = lo.clip(0, n_in - 1), hi.clip(0, n_in - 1)
    frac = (at - lo.astype(F32)).astype(F32).clip(F32(0), F32(1))
    return lo, hi, frac


def bilinear_aligned(table: np.ndarray, width: int, height: int) -> np.ndarray:
    """table (rows, cols, C) float32 -> (height, width, C): a*(1-dx)*(1-dy) + b*dx*(1-dy) +
    c*(1-dx)*dy + d*dx*dy, contracted as gcc builds ggml: the first term's last product fused
    with the second term, the third's and fourth's into the running sum (measured against
    ggml_interpolate itself)."""
    y0, y1, dy = _taps(height, table.shape[0])
    x0, x1, dx = _taps(width, table.shape[1])
    dx, dy = dx[None, :, None], dy[:, None, None]
    a, b = table[y0][:, x0], table[y0][:, x1]
    c, d = table[y1][:, x0], table[y1][:, x1]
    one = F32(1)
    wx0, wy0 = (one - dx).astype(F32), (one - dy).astype(F32)

    def fma(p, q, r):                      # p*q + r, one rounding (p*q exact in float64)
        return (p.astype(np.float64) * q + r).astype(F32)
    acc = fma((a * wx0).astype(F32), wy0, ((b * dx).astype(F32) * wy0).astype(F32))
    acc = fma((c * wx0).astype(F32), dy, acc)
    return fma((d * dx).astype(F32), dy, acc)
