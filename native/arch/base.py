"""What every architecture family declares, and the layer most of them share.

A family says which GGUF tensors a layer needs (`matrices`: multiplied by the kernels;
`vectors`: float32 norms and biases; `fused`: one stored matrix that holds several, split by
rows at load), reads its own hyperparameters from the metadata (`hparams`), and builds each
layer from those tensors (`layer_weights`): its own dataclass, composed of the parts in
native/arch/parts.py (attention, FFN, routed experts) and its own, each carrying its forward.
How a layer runs — one compiled call per decode step, streamed experts, its blocks through the
compiled products or numpy — is chosen at load, in native/runners.py, and is invisible here.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .parts import FFN, Attention, Layer, MoE, SharedExpertMoE, take, vector_weight

# Sane ranges of hyperparameters (native/config.py checks every one it reads): above every
# released model, far below what would exhaust memory or time.
MAX_WIDTH = 2**20                # embedding, FFN and head widths, head and expert counts
MAX_LAYERS = 4096
MAX_CONTEXT = 2**24              # positions: above the longest trained context (10M)


def check_window(c, key) -> None:
    """A sliding window longer than the context is corrupt (and would size the window's buffers)."""
    if c.get("sliding_window") > c.n_ctx_train:
        key.fail("attention.sliding_window", c.get("sliding_window"), f"longer than the context, {c.n_ctx_train}")


class Family:
    name = "base"
    aliases: tuple[str, ...] = ()
    rope = "normal"               # "normal": adjacent pairs (llama); "neox": rotate-half
    norm_topk = False             # MoE: renormalise the top-k router weights (when the file says nothing)
    moe = False                   # routed experts in every layer
    shared_expert = False
    attention = Attention         # the part a layer attends with (a family's: biases, q/k norms, …)
    output_norm = "output_norm.weight"   # the final norm's tensor (LFM2 names it token_embd_norm)
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
        """Family-specific configuration read with key(name, default, required=False, kind=, lo=,
        hi=) (native/config.py's Keys: each value checked as it is read)."""
        return {}

    def check(self, c, key) -> None:
        """Hyperparameters that must agree with each other, checked once the config is whole;
        key.fail(name, value, problem) refuses the file."""
        if self.moe and not c.n_expert:
            key.fail("expert_count", c.n_expert, f"a {self.name} model has routed experts")

    def field_shapes(self, c, i: int, stored: Callable[[str, int], int]) -> dict[str, tuple]:
        """The shape (numpy order) each field of layer i is computed with. `stored(name, axis)` is
        a tensor's stored width along an axis (0 if it has none), for the widths the metadata does
        not fix: an FFN's, an expert's."""
        E, d = c.n_embd, c.head_dim
        q, kv = c.n_head * d, c.n_head_kv * d
        per_head = getattr(self, "qk_norm", "head") == "head"
        mats = self.matrices(c, i)
        ff = stored(mats["gate"], 0) if "gate" in mats else c.n_ff
        out = {"wq": (q, E), "wk": (kv, E), "wv": (kv, E), "wo": (E, q), "bq": (q,), "bk": (kv,), "bv": (kv,),
               "bo": (E,), "gate": (ff, E), "up": (ff, E), "down": (E, ff), "attn_norm": (E,), "ffn_norm": (E,),
               "post_attn_norm": (E,), "post_ffn_norm": (E,), "q_norm": (d,) if per_head else (q,),
               "k_norm": (d,) if per_head else (kv,)}
        if "gate_exps" in mats:
            X, fe = c.n_expert, stored(mats["gate_exps"], 1)
            out |= {"router": (X, E), "gate_exps": (X, fe, E), "up_exps": (X, fe, E), "down_exps": (X, E, fe)}
        if "gate_shexp" in mats:
            fs = stored(mats["gate_shexp"], 0)
            out |= {"gate_shexp": (fs, E), "up_shexp": (fs, E), "down_shexp": (E, fs), "shared_gate": (E,)}
        return out

    def shapes(self, c, i: int, stored: Callable[[str, int], int]) -> dict[str, tuple | None]:
        """Every tensor layer i needs -> the shape it must have (None: any)."""
        fields = self.field_shapes(c, i, stored)
        out = {n: fields.get(f) for f, n in (self.matrices(c, i) | self.vectors(c, i)).items()}
        return out | {n: (sum(rows for _, rows in parts), c.n_embd) for n, parts in self.fused(c, i).items()}

    def model_tensors(self, g) -> dict[str, str]:
        """Whole-model vectors beyond the norms (e.g. rope_freqs), field -> name, if present."""
        return {}

    # -- the layer ----------------------------------------------------------------------------

    def layer_weights(self, c, i: int, t: dict) -> Layer:
        """Layer i from its loaded tensors `t` (field -> Weight or float32 vector): the llama
        skeleton of the family's attention and its FFN."""
        return Layer(attn_norm=t["attn_norm"], attn=self.attention_weights(c, i, t), ffn_norm=t["ffn_norm"],
                     ffn=self.ffn_weights(c, i, t))

    def attention_weights(self, c, i: int, t: dict) -> Attention:
        window = c.get("sliding_window") if self.sliding(c, i) else 0
        return take(self.attention, t, window=window)

    def ffn_weights(self, c, i: int, t: dict) -> FFN | MoE:
        if not c.is_moe:
            return take(FFN, t)
        if self.shared_expert:
            gate = vector_weight(self.vectors(c, i)["shared_gate"], t["shared_gate"])
            return take(SharedExpertMoE, t, shared_gate=gate)
        return take(MoE, t)

    def kv_layers(self, c) -> list[int]:
        """The layers whose keys and values grow with the context (not recurrent, not sliding).
        c.n_layer is bounded: read_config requires it to be the layers the file holds."""
        rec = self.recurrent_state(c)
        return [i for i in range(c.n_layer) if i not in rec and not self.sliding(c, i)]

    def kv_bytes_per_token(self, c, k_bytes: float = 2, v_bytes: float | None = None) -> int:
        """Bytes a position's keys and values take, at k_bytes and v_bytes a value (fp16 2,
        q8_0 34/32, q4_0 18/32)."""
        v_bytes = k_bytes if v_bytes is None else v_bytes
        return round(len(self.kv_layers(c)) * c.n_head_kv * c.head_dim * (k_bytes + v_bytes))

    def window_kv_bytes(self, c, k_bytes: float = 2, v_bytes: float | None = None, chunk: int = 256) -> int:
        """Keys and values the sliding-window layers hold at most: their window and one chunk."""
        v_bytes = k_bytes if v_bytes is None else v_bytes
        n = sum(self.sliding(c, i) for i in range(c.n_layer))
        return round(n * c.n_head_kv * c.head_dim * (k_bytes + v_bytes) * (c.get("sliding_window", 0) + chunk)) if n else 0

    def recurrent_state_bytes(self, c) -> int:
        """Bytes of recurrent state one sequence holds (float32), whatever its length."""
        return sum(4 * math.prod(s) for st in self.recurrent_state(c).values() for s in st.values())

    def recurrent_state(self, c) -> dict[int, dict[str, tuple]]:
        """Per-sequence state of recurrent layers: layer -> {name: shape} (none by default)."""
        return {}

    def embed_scale(self, c) -> float | None:
        """Token embeddings are multiplied by this before the first layer (gemma: √n_embd)."""
        return None

    def sliding(self, c, i: int) -> bool:
        """Does layer i attend within a sliding window (of c.get("sliding_window") positions)?"""
        return False

    def rotated_key_start(self, c) -> int:
        """Where a cached key row's rotated dimensions begin (a context shift turns them)."""
        return 0

    def yarn_attn_factor(self, c) -> float:
        """The attention factor YaRN's rope tables are made with (the file's; deepseek2 has its own)."""
        return c.yarn[3]

    def attention_scales(self, c) -> tuple[float, float]:
        """(q_scale, kq_scale): q multiplied after RoPE (0: not), the scores' scale (0: 1/sqrt(d))."""
        return 0.0, 0.0

    def facts(self, c) -> dict:
        """What `kiln models inspect` shows about this family's model beyond the common fields."""
        return {}

    def needs(self, c, g) -> str:
        """What this file needs of the family (`kiln models inspect`): its notes, less the
        variants the file is not (a family whose variants differ overrides it)."""
        return self.notes
