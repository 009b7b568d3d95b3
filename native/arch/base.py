"""What every architecture family declares, and the layer skeleton most of them share.

A family says which GGUF tensors a layer needs (`matrices`: multiplied by the kernels;
`vectors`: float32 norms and biases; `fused`: one stored matrix that holds several, split by
rows at load), reads its own hyperparameters from the metadata (`hparams`), and writes its
`layer()` as named blocks of the model: norm, attention, ffn. Which kernel runs a block — the
one-call compiled decode, the compiled products, numpy — is decided below, in native/model.py,
and is invisible here.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


class Family:
    name = "base"
    aliases: tuple[str, ...] = ()
    rope = "normal"               # "normal": adjacent pairs (llama); "neox": rotate-half
    norm_topk = False             # MoE: renormalise the top-k router weights (when the file says nothing)
    moe = False                   # routed experts in every layer
    shared_expert = False
    # True when layer() is the llama skeleton below (pre-norm attention, pre-norm FFN): such a
    # layer may run as one compiled call per decode step
    llama_skeleton = True
    notes = ""                    # what the family needed, for the README and `models inspect`

    # -- what a layer needs -------------------------------------------------------------------

    def matrices(self, c, i: int) -> dict[str, str]:
        p = f"blk.{i}."
        mats = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output"}
        if c.is_moe:
            mats |= {"gate_exps": "ffn_gate_exps", "up_exps": "ffn_up_exps", "down_exps": "ffn_down_exps",
                     "router": "ffn_gate_inp"}
            if self.shared_expert:
                mats |= {"gate_shexp": "ffn_gate_shexp", "up_shexp": "ffn_up_shexp", "down_shexp": "ffn_down_shexp"}
        else:
            mats |= {"gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
        return {k: p + v + ".weight" for k, v in mats.items()}

    def vectors(self, c, i: int) -> dict[str, str]:
        p = f"blk.{i}."
        return {"attn_norm": p + "attn_norm.weight", "ffn_norm": p + "ffn_norm.weight"}

    def fused(self, c, i: int) -> dict[str, tuple[tuple[str, int], ...]]:
        """Stored matrices that hold several of a layer's: name -> ((field, rows), …) in row order."""
        return {}

    def hparams(self, key: Callable[..., Any]) -> dict:
        """Family-specific configuration read with key(name, default, required=False)."""
        return {}

    def model_tensors(self, g) -> dict[str, str]:
        """Whole-model vectors beyond the norms (e.g. rope_freqs), field -> name, if present."""
        return {}

    # -- the forward --------------------------------------------------------------------------

    def layer(self, m, i: int, L, x: np.ndarray, ctx) -> np.ndarray:
        """The llama skeleton: x + attention(norm(x)), then + ffn(norm(x))."""
        x = x + m.attention(i, L, m.norm(x, L.attn_norm), ctx)
        ctx.residual = x
        return x + m.ffn(i, L, m.norm(x, L.ffn_norm), ctx)

    def kv_layers(self, c) -> list[int]:
        """The layers whose keys and values grow with the context (not recurrent, not sliding)."""
        rec = self.recurrent_state(c)
        return [i for i in range(c.n_layer) if i not in rec and not self.sliding(c, i)]

    def kv_bytes_per_token(self, c, itemsize: int = 2) -> int:
        return 2 * len(self.kv_layers(c)) * c.n_head_kv * c.head_dim * itemsize

    def window_kv_bytes(self, c, itemsize: int = 2, chunk: int = 256) -> int:
        """Keys and values the sliding-window layers hold at most: their window and one chunk."""
        n = sum(self.sliding(c, i) for i in range(c.n_layer))
        return 2 * n * c.n_head_kv * c.head_dim * itemsize * (c.get("sliding_window", 0) + chunk) if n else 0

    def recurrent_state_bytes(self, c) -> int:
        """Bytes of recurrent state one sequence holds (float32), whatever its length."""
        import numpy as np
        return sum(4 * int(np.prod(s)) for st in self.recurrent_state(c).values() for s in st.values())

    def recurrent_state(self, c) -> dict[int, dict[str, tuple]]:
        """Per-sequence state of recurrent layers: layer -> {name: shape} (none by default)."""
        return {}

    def embed_scale(self, c) -> float | None:
        """Token embeddings are multiplied by this before the first layer (gemma: √n_embd)."""
        return None

    def sliding(self, c, i: int) -> bool:
        """Does layer i attend within a sliding window (of c.get("sliding_window") positions)?"""
        return False

    def attention_scales(self, c) -> tuple[float, float]:
        """(q_scale, kq_scale): q multiplied after RoPE (0: not), the scores' scale (0: 1/sqrt(d))."""
        return 0.0, 0.0

    def facts(self, c) -> dict:
        """What `kiln models inspect` shows about this family's model beyond the common fields."""
        return {}
