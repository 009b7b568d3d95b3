"""lfm2 (Liquid's LFM2 350M–2.6B, built for laptops): the llama skeleton whose token mixer is, in
most layers, a gated short convolution instead of attention — as llama.cpp runs it
(src/models/lfm2.cpp):

    conv layer (head_count_kv 0):  B, C, x = in_proj(h);  y = C · conv(B · x);  out_proj(y)
        conv: causal and depthwise over the last shortconv.l_cache positions, the previous
        l_cache - 1 inputs (B · x) kept per sequence as its state
    attention layer:  per-head q/k RMSNorm, rotate-half rope, GQA
    every layer:      RMSNorm before the mixer and before a SwiGLU FFN; the final norm is stored
                      as token_embd_norm
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import Weight
from .base import MAX_WIDTH, Family
from .parts import Layer, NormedAttention, take

F32 = np.float32


@dataclass(kw_only=True)
class ShortConv:
    """LFM2's gated short convolution; its state: each sequence's last l_cache - 1 inputs."""
    in_proj: Weight                # (3 n_embd, n_embd): B | C | x
    out_proj: Weight
    conv: np.ndarray               # (n_embd, l_cache): each channel's kernel, oldest position first

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        E = x.shape[1]
        bcx = b.mm(x, self.in_proj)
        bx = bcx[:, :E] * bcx[:, 2 * E:]
        y = np.empty_like(bx)
        K = self.conv.shape[1]
        for cache, a, e in b.segments:
            st = cache.recurrent_state(i)["conv"]                         # (K - 1, E)
            seq = np.concatenate([st, bx[a:e]])
            st[:] = seq[-(K - 1):]
            T = e - a
            # ggml_ssm_conv: the taps in order, each a fused multiply-add (its C loop, contracted): the
            # product exact in double, one rounding of product plus sum to float32
            acc = seq[0:T] * self.conv[:, 0]
            for j in range(1, K):
                acc = (seq[j:j + T].astype(np.float64) * self.conv[:, j] + acc).astype(F32)
            y[a:e] = acc
        return b.mm(np.ascontiguousarray(bcx[:, E:2 * E] * y, F32), self.out_proj)


class Lfm2(Family):
    name, rope, norm_topk = "lfm2", "neox", False
    notes = "gated short-convolution layers (a conv state per sequence) and q/k-normed attention layers"
    output_norm = "token_embd_norm.weight"
    kv_heads_per_layer = True
    qk_norm = "head"

    def hparams(self, key) -> dict:
        return {"l_cache": key("shortconv.l_cache", kind=int, lo=2, hi=MAX_WIDTH)}

    def check(self, c, key) -> None:
        super().check(c, key)
        if not c.get("kv_heads"):
            key.fail("attention.head_count_kv", c.n_head_kv, "an LFM2 model gives it per layer (0: a convolution layer)")
        if key("attention.sliding_window", 0, required=False, kind=int, lo=0):
            key.fail("attention.sliding_window", key("attention.sliding_window", 0, required=False),
                     "LFM2's sliding-window variant is not supported yet")
        if c.is_moe:
            key.fail("expert_count", c.n_expert, "LFM2's experts are lfm2moe, which Kiln does not run yet")

    def recurrent(self, c, i: int) -> bool:
        return c.get("kv_heads")[i] == 0

    def matrices(self, c, i):
        p = f"blk.{i}."
        mats = {k: v for k, v in super().matrices(c, i).items() if k not in ("wq", "wk", "wv", "wo")}
        if self.recurrent(c, i):
            return mats | {"in_proj": p + "shortconv.in_proj.weight", "out_proj": p + "shortconv.out_proj.weight"}
        return mats | {k: p + v + ".weight" for k, v in
                       (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output"))}

    def vectors(self, c, i):
        p = f"blk.{i}."
        v = super().vectors(c, i)
        if self.recurrent(c, i):
            return v | {"conv": p + "shortconv.conv.weight"}
        return v | {"q_norm": p + "attn_q_norm.weight", "k_norm": p + "attn_k_norm.weight"}

    def field_shapes(self, c, i, stored):
        E = c.n_embd
        return super().field_shapes(c, i, stored) | {"in_proj": (3 * E, E), "out_proj": (E, E),
                                                     "conv": (E, c.get("l_cache"))}

    def recurrent_state(self, c) -> dict[int, dict[str, tuple]]:
        return {i: {"conv": (c.get("l_cache") - 1, c.n_embd)} for i in range(c.n_layer) if self.recurrent(c, i)}

    def facts(self, c) -> dict:
        conv = sum(self.recurrent(c, i) for i in range(c.n_layer))
        return {"convolution_layers": conv, "attention_layers": c.n_layer - conv, "shortconv_l_cache": c.get("l_cache"),
                "recurrent_state_bytes": self.recurrent_state_bytes(c)}

    def layer_weights(self, c, i, t):
        mixer = take(ShortConv, t) if self.recurrent(c, i) else take(NormedAttention, t)
        return Layer(attn_norm=t["attn_norm"], attn=mixer, ffn_norm=t["ffn_norm"], ffn=self.ffn_weights(c, i, t))
