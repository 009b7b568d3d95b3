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
    out = np.empty((n, width), F32)
    hidden = None if blocks is None else blocks[:, None] != blocks[None, :]
    for h in range(H):                 # one head's (n, n) scores at a time: a large image's are big
        cols = slice(h * d, (h + 1) * d)
        s = (q[:, cols] @ k[:, cols].T) * scale
        if hidden is not None:
            s[hidden] = -np.inf
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        out[:, cols] = s @ v[:, cols]
    return out
