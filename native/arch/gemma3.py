"""gemma3 (Gemma 3): embeddings × √n_embd; per layer RMSNorm → attention (per-head q/k RMSNorm,
rotate-half rope, q × 1/√key_length and scores × 1) → RMSNorm of its output → residual; RMSNorm →
GELU-gated FFN → RMSNorm of its output → residual. Five of every six layers attend within a
sliding window (llama.cpp's default pattern: layer i is global iff i % 6 == 5) with their own
rope base (`rope.freq_base_swa`, 10 000 when the file has none); the output head is the
token embedding (tied)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..kernels import matmul_many
from .base import MAX_CONTEXT, MAX_LAYERS, Family, check_window
from .parts import FFN, Layer, NormedAttention, take

F32 = np.float32


@dataclass(kw_only=True)
class GeluFFN(FFN):
    """GELU-gated: down(gelu(gate x) · up x)."""

    def __call__(self, i, x, b):
        g, u = (b.project(x, w) for w in (self.gate, self.up)) if b.adapter is not None \
            else matmul_many(x, [self.gate, self.up])
        return b.project(kernels.geglu(g, u), self.down)


@dataclass(kw_only=True)
class Gemma3Layer(Layer):
    """Each block's output RMS-normed before it joins the residual stream."""
    post_attn_norm: np.ndarray
    post_ffn_norm: np.ndarray

    def __call__(self, i, x, b):
        h = self.attn(i, b.norm(x, self.attn_norm), b)
        x = x + b.norm(h, self.post_attn_norm)
        h = self.ffn(i, b.norm(x, self.ffn_norm), b)
        return x + b.norm(h, self.post_ffn_norm)


class Gemma3(Family):
    name, rope = "gemma3", "neox"
    qk_norm = "head"
    notes = ("embeddings × √n_embd, four norms per layer, per-head q/k norms, GELU-gated FFN, "
             "sliding-window layers (pattern 6, own rope base), tied output")

    def vectors(self, c, i):
        p = f"blk.{i}."
        return {"attn_norm": p + "attn_norm.weight", "q_norm": p + "attn_q_norm.weight",
                "k_norm": p + "attn_k_norm.weight", "post_attn_norm": p + "post_attention_norm.weight",
                "ffn_norm": p + "ffn_norm.weight", "post_ffn_norm": p + "post_ffw_norm.weight"}

    def hparams(self, key) -> dict:
        pattern = key("attention.sliding_window_pattern", 6, required=False)
        if isinstance(pattern, (list, np.ndarray)):   # newer files: one flag per layer (true: sliding)
            pattern = tuple(bool(x) for x in pattern)
        else:
            pattern = key("attention.sliding_window_pattern", 6, required=False, kind=int, lo=0, hi=MAX_LAYERS)
        return {"sliding_window": key("attention.sliding_window", 0, required=False, kind=int, lo=0, hi=MAX_CONTEXT),
                "swa_pattern": pattern,
                "rope_base_swa": key("rope.freq_base_swa", 10000.0, required=False, kind=float, lo=1.0, hi=1e15)}

    def check(self, c, key) -> None:
        super().check(c, key)
        pattern = c.get("swa_pattern")
        if isinstance(pattern, tuple) and len(pattern) != c.n_layer:
            key.fail("attention.sliding_window_pattern", pattern, f"needs one flag for each of the {c.n_layer} layers")
        check_window(c, key)

    def sliding(self, c, i: int) -> bool:
        pattern = c.get("swa_pattern")
        if not c.get("sliding_window"):
            return False
        if isinstance(pattern, tuple):
            return pattern[i]
        return (i % int(pattern)) != int(pattern) - 1 if pattern else False

    def attention_scales(self, c):
        # llama.cpp: q × 1/√key_length (n_embd/n_head for the 62-layer 27B), scores × 1
        d = c.n_embd / c.n_head if c.n_layer == 62 else c.head_dim
        return float(F32(1) / np.sqrt(F32(d))), 1.0

    def embed_scale(self, c) -> float:
        return float(np.sqrt(F32(c.n_embd)))

    def layer_weights(self, c, i, t):
        """Sliding layers attend within the window with their own rope base."""
        local = self.sliding(c, i)
        attn = take(NormedAttention, t, window=c.get("sliding_window") if local else 0,
                    rope_base=c.get("rope_base_swa") if local else None)
        return take(Gemma3Layer, t, attn=attn, ffn=take(GeluFFN, t))

    def facts(self, c) -> dict:
        local = [i for i in range(c.n_layer) if self.sliding(c, i)]
        return {"sliding_window": c.get("sliding_window"), "sliding_layers": len(local),
                "global_layers": c.n_layer - len(local), "rope_base_swa": c.get("rope_base_swa")}
