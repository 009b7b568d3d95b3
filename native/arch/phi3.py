"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): the llama skeleton with fused projections — `attn_qkv`
holds q | k | v and `ffn_up` holds gate | up, split by rows at load (a row of blocks is a row
of weights, so the split copies nothing and changes no bit). Rotate-half rope.

Phi-3 128k files ("longrope") carry two sets of per-pair rope factors and an attention factor
that scales cos/sin: llama.cpp uses `rope_factors_long` when the context it runs with exceeds
`rope.scaling.original_context_length`, else `rope_factors_short` (Model.use_context). A Phi-3
file's sliding window is read and ignored, as llama.cpp ignores it (its "Phi SWA is currently
disabled" — the released models were trained to the full context anyway)."""

from __future__ import annotations

import numpy as np

from .base import Family


class Phi3(Family):
    name, rope = "phi3", "neox"
    notes = ("fused attn_qkv (q|k|v) and ffn_up (gate|up) split by rows at load; rotate-half rope; "
             "longrope factors (long/short by context) and attn_factor")

    def model_tensors(self, g):
        names = {"rope_long": "rope_factors_long.weight", "rope_short": "rope_factors_short.weight"}
        return {k: n for k, n in names.items() if n in g.tensors}

    def matrices(self, c, i):
        p = f"blk.{i}."
        return {"wo": p + "attn_output.weight", "down": p + "ffn_down.weight"}

    def facts(self, c) -> dict:
        if not c.n_ctx_orig:
            return {}
        return {"longrope_original_context": c.n_ctx_orig, "rope_attn_factor": round(c.rope_attn_factor, 4),
                "rope_factors": "long past the original context, else short"}

    def fused(self, c, i):
        p = f"blk.{i}."
        q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        return {p + "attn_qkv.weight": (("wq", q), ("wk", kv), ("wv", kv)),
                p + "ffn_up.weight": (("gate", c.n_ff), ("up", c.n_ff))}

    def attention_scales(self, c):
        # llama.cpp scales the roped q by 1/sqrt(head_dim) and the scores by 1
        return float(np.float32(1) / np.sqrt(np.float32(c.head_dim))), 1.0
