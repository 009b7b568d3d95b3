"""Bidirectional attention over an image's patches, as clip.cpp's build_attn computes it without
flash attention: the BERT encoders' C kernel (kernels.encoder_attention), numpy without it."""

from __future__ import annotations

import numpy as np

from .. import kernels

F32 = np.float32


def patch_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, H: int, scale) -> np.ndarray:
    out = kernels.encoder_attention(q, k, v, H, scale)
    if out is not None:
        return out
    n, width = q.shape
    d = width // H
    qh, kh, vh = (m.reshape(n, H, d).transpose(1, 0, 2) for m in (q, k, v))
    s = (qh @ kh.transpose(0, 2, 1)) * scale
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return (s @ vh).transpose(1, 0, 2).reshape(n, width).astype(F32)
