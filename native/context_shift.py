"""llama-server's context shift on a model's cache: the keys after the dropped positions turned
back by n_discard positions with each layer's rope, as llama.cpp's K-shift does (KVCache.shift
moves the rows)."""

from __future__ import annotations

import numpy as np

from .blocks import apply_rope, rope_shift_table


def shift_cache(model, cache, n_keep: int, n_discard: int) -> None:
    c = model.config
    if not model.can_shift_over(cache.tokens):
        raise ValueError("the context cannot shift on this model: M-RoPE places its rows (an image takes fewer "
                         "positions than rows; Qwen3-VL keeps some pairs at position 0), as llama.cpp refuses it")
    tables: dict = {}

    def rope_keys(i: int, k: np.ndarray) -> None:
        base = getattr(getattr(model.layers[i], "attn", None), "rope_base", None) or c.rope_base
        if base not in tables:
            tables[base] = rope_shift_table(-n_discard, c.rope_dim, base, c.rope_scale,
                                            model.rope_factors, model.rope_yarn)
        cos, sin = tables[base]
        at = model.family.rotated_key_start(c)     # MLA's key rows rotate their last dimensions
        part = np.ascontiguousarray(k[..., at:at + c.rope_dim])
        k[..., at:at + c.rope_dim] = apply_rope(part, np.repeat(cos, len(k), 0), np.repeat(sin, len(k), 0),
                                                c.rope_style)

    cache.shift(n_keep, n_discard, rope_keys)
