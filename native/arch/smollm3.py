"""smollm3 (SmolLM3): the llama skeleton whose every fourth layer attends without positions
(NoPE) — llama.cpp's n_no_rope_layer_step, 4, which it does not read from the file."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blocks import F32
from .llama import Llama
from .parts import Attention, take

NO_ROPE_STEP = 4


@dataclass(kw_only=True)
class NoRopeAttention(Attention):
    """Attention whose queries and keys carry no rotation: a NoPE layer."""

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        c = b.config
        q, k, v = self.heads(c, *b.project_many(x, (self.wq, self.wk, self.wv)))
        q, k = np.ascontiguousarray(q), np.ascontiguousarray(k)
        q_scale, kq_scale = b.attn_scales
        if q_scale:
            q *= F32(q_scale)
        return b.project(b.attend(i, q, k, v, kq_scale or None, self.window), self.wo)


class SmolLM3(Llama):
    name, aliases = "smollm3", ()
    notes = "the llama skeleton with no RoPE on every fourth layer (NoPE)"

    def needs(self, c, g) -> str:
        return f"RMSNorm, SwiGLU, GQA, rope on adjacent pairs except every {NO_ROPE_STEP}th layer (NoPE)"

    def attention_weights(self, c, i: int, t: dict) -> Attention:
        if (i + 1) % NO_ROPE_STEP == 0:
            return take(NoRopeAttention, t, window=0)
        return super().attention_weights(c, i, t)
