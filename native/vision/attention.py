"""Bidirectional attention over an image's patches, as clip.cpp's build_attn computes it without
flash attention: the BERT encoders' C kernel (kernels.encoder_attention), numpy without it."""

from __future__ import annotations

import numpy as np

from .. import kernels

F32 = np.float32


def patch_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, H: int, scale,
                    blocks: np.ndarray | None = None) -> np.ndarray:
    """`blocks` (n): a patch sees only the patches of its own block (Qwen2.5-VL's windows)."""
    out = kernels.encoder_attention(q, k, v, H, scale, blocks=blocks)
    if out is not None:
        return out
    n, width = q.shape
    d = width // H
    qh, kh, vh = (m.reshape(n, H, d).transpose(1, 0, 2) for m in (q, k, v))
    s = (qh @ kh.transpose(0, 2, 1)) * scale
    if blocks is not None:
        s[:, blocks[:, None] != blocks[None, :]] = -np.inf
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return (s @ vh).transpose(1, 0, 2).reshape(n, width).astype(F32)
