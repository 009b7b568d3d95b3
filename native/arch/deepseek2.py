"""deepseek2 (DeepSeek-V2 / V2-Lite, Moonlight, Kimi-style): multi-head latent attention (MLA)
and routed experts with shared ones, as llama.cpp runs them (src/models/deepseek2.cpp).

MLA, in the layout current converters write (attn_k_b / attn_v_b, `key_length_mla`): one key
row a position — the normed compressed KV (kv_lora_rank values) and a rotated part shared by
every head (the rope dimensions) — so the cache holds one KV "head". Each head's query is its
no-rope part absorbed through attn_k_b into the compressed space, beside its rotated part; the
values are the compressed rows, and each head's output goes back through attn_v_b to its value
width. Mathematically multi-head attention with keys [k_nope | k_pe]; computed as llama.cpp
computes it, so the bits follow. (The cache here keeps the compressed rows again as the values —
twice llama.cpp's KV bytes, which reads the values as a view of the keys.)

Experts: llama.cpp's build_moe_ffn for deepseek2 — softmax (V2) or sigmoid (V3) gating, a
selection bias where the file has one, groups kept by the sum of their two best scores when
there are several, weights optionally renormalised and scaled; shared experts (ungated) added.
The first `leading_dense_block_count` layers have a dense SwiGLU instead.

Refused by name: the legacy layout (attn_kv_b, no *_mla keys — re-convert the model), YaRN beta
values other than 32/1 (llama.cpp does not read them for this family).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ggml_round
from ..blocks import _libm, apply_rope, route, swiglu_ffn
from ..kernels import Weight, matmul
from .base import MAX_LAYERS, MAX_WIDTH, Family
from .ernie import ErnieMoE
from .parts import FFN, Layer, take

F32 = np.float32
SOFTMAX, SIGMOID = 1, 2


def _logf(v) -> F32:
    libm = _libm()
    return F32(libm.logf(float(v))) if libm else F32(np.log(np.float64(F32(v))))


def absorb(q_nope: np.ndarray, w: Weight) -> np.ndarray:
    """One head's no-rope query through attn_k_b: (T, qk_nope) -> (T, kv_lora_rank). ggml
    multiplies a permuted view here, so for F32 weights it runs vec_dot_f32 row by row (tinyBLAS
    wants contiguous activations); other types are converted to contiguous rows first and take
    the usual product."""
    if int(w.qtype) == 0:                                           # F32
        return ggml_round.vec_dot_f32_rows(w.dense, np.ascontiguousarray(q_nope, F32))
    return matmul(np.ascontiguousarray(q_nope), w)


@dataclass(kw_only=True)
class LatentAttention:
    """MLA (see the module's text). `wq` when the file has no low-rank query (V2-Lite), else
    wq_a → RMS norm → wq_b."""
    wkv_a: Weight                  # (kv_lora_rank + rope, n_embd): compressed kv, then k_pe
    kv_a_norm: np.ndarray
    wk_b: Weight                   # (n_head, kv_lora_rank, qk_nope)
    wv_b: Weight                   # (n_head, v_head, kv_lora_rank)
    wo: Weight
    wq: Weight | None = None
    wq_a: Weight | None = None
    q_a_norm: np.ndarray | None = None
    wq_b: Weight | None = None
    window: int = 0

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        c = b.config
        H, R, C, vd = c.n_head, c.rope_dim, c.get("kv_lora_rank"), c.get("v_head")
        nope = c.get("k_mla") - R
        T = x.shape[0]
        if self.wq is not None:
            q, kv = b.project_many(x, (self.wq, self.wkv_a))
        else:
            qa, kv = b.project_many(x, (self.wq_a, self.wkv_a))
            q = b.project(b.norm(qa, self.q_a_norm), self.wq_b)
        q = q.reshape(T, H, nope + R)
        cos, sin = b.rope()
        k_pe = apply_rope(np.ascontiguousarray(kv[:, C:]).reshape(T, 1, R), cos, sin, c.rope_style)
        ckv = b.norm(np.ascontiguousarray(kv[:, :C]), self.kv_a_norm)
        q_pe = apply_rope(np.ascontiguousarray(q[:, :, nope:]), cos, sin, c.rope_style)
        q_abs = np.stack([absorb(q[:, h, :nope], self.wk_b.expert(h)) for h in range(H)], axis=1)
        query = np.concatenate([q_abs, q_pe], axis=-1)                      # (T, H, C + R): absorbed part first
        key = np.concatenate([ckv, k_pe[:, 0]], axis=-1).reshape(T, 1, C + R)
        # the values: the compressed rows (the key rows' first C), padded to the cache's width
        # with zeros — not the rotated part, which a context shift turns in the keys only
        value = np.concatenate([ckv, np.zeros((T, R), F32)], axis=-1).reshape(T, 1, C + R)
        o = b.attend(i, query, key, value, b.attn_scales[1])
        o = o.reshape(T, H, C + R)
        out = np.stack([matmul(np.ascontiguousarray(o[:, h, :C]), self.wv_b.expert(h)) for h in range(H)], axis=1)
        return b.project(out.reshape(T, H * vd), self.wo)


@dataclass(kw_only=True)
class DeepSeekMoE(ErnieMoE):
    """build_moe_ffn as deepseek2.cpp calls it (see the module's text)."""
    gating: int = SOFTMAX
    groups: int = 0
    groups_used: int = 0
    norm: bool = False
    scale: float = 0.0

    def rule(self) -> tuple:
        return self.probs_b, self.gating == SIGMOID, self.groups, self.groups_used, self.scale

    def keep_groups(self, pick: np.ndarray) -> np.ndarray:
        """Keep the groups whose two best scores sum highest; the others' experts out of reach."""
        if self.groups <= 1:
            return pick
        T, X = pick.shape
        g = pick.reshape(T, self.groups, X // self.groups)
        best2 = -np.sort(-g, axis=-1, kind="stable")[:, :, :2]
        score = best2[:, :, 0] + best2[:, :, 1]
        keep = np.argsort(-score, axis=-1, kind="stable")[:, :self.groups_used]
        mask = np.full((T, self.groups), -np.inf, F32)
        np.put_along_axis(mask, keep, F32(0), axis=-1)
        return (g + mask[:, :, None]).reshape(T, X)

    def probs(self, logits: np.ndarray) -> np.ndarray:
        if self.gating == SOFTMAX:
            return ggml_round.softmax(logits)
        return F32(1) / (F32(1) + ggml_round.libm_expf(-logits))      # ggml_vec_sigmoid_f32: 1 / (1 + expf(-x))

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        k = b.config.n_expert_used
        experts, weights = route(x, self.router, k, self.norm, self.rule(),
                                 lambda logits: self.choose(self.probs(logits), k, self.norm, self.scale))
        residual, b.residual = b.residual, None
        out = b.experts.ffn(i, self, x, experts, weights, residual)
        return out + swiglu_ffn(x, self.gate_shexp, self.up_shexp, self.down_shexp, b.mm)


class DeepSeek2(Family):
    name = "deepseek2"
    rope = "normal"
    moe = True
    norm_topk = False
    notes = ("multi-head latent attention (compressed KV, absorbed queries); leading dense layers, then routed "
             "experts (softmax or sigmoid gating, grouped selection) with shared experts")

    def hparams(self, key) -> dict:
        n_layer = key("block_count", kind=int, lo=1)
        return {"q_lora_rank": key("attention.q_lora_rank", 0, required=n_layer not in (26, 27), kind=int, lo=0,
                                   hi=MAX_WIDTH),
                "kv_lora_rank": key("attention.kv_lora_rank", kind=int, lo=1, hi=MAX_WIDTH),
                "k_mla": key("attention.key_length_mla", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
                "v_head": key("attention.value_length_mla", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
                "value_length": key("attention.value_length", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
                "dense_lead": key("leading_dense_block_count", 0, required=False, kind=int, lo=0, hi=MAX_LAYERS),
                "n_shared": key("expert_shared_count", kind=int, lo=1, hi=MAX_WIDTH),
                "weights_scale": key("expert_weights_scale", 0.0, required=False, kind=float, lo=0.0, hi=1e6),
                "gating": key("expert_gating_func", SOFTMAX, required=False, kind=int, lo=0, hi=2),   # 0: softmax
                "groups": key("expert_group_count", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
                "groups_used": key("expert_group_used_count", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
                # stored as 0.1 · mscale_all_dim; llama.cpp divides by 0.1f in float
                "yarn_log_mul": float(F32(key("rope.scaling.yarn_log_multiplier", 0.0, required=False, kind=float,
                                              lo=0.0, hi=1e6)) / F32(0.1)),
                "probs_b": any(n.endswith(".exp_probs_b.bias") for n in key.g.tensors)}

    def check(self, c, key) -> None:
        super().check(c, key)
        C, R = c.get("kv_lora_rank"), c.rope_dim
        if not c.get("k_mla") or not c.get("v_head"):
            key.fail("attention.key_length_mla", c.get("k_mla"), "absent: the legacy layout (attn_kv_b) — re-convert "
                     "the model with a current convert_hf_to_gguf.py, which writes attn_k_b and attn_v_b")
        if c.n_head_kv != 1:
            key.fail("attention.head_count_kv", c.n_head_kv, "must be 1 (MLA caches one latent row a position)")
        if c.head_dim != C + R:
            key.fail("attention.key_length", c.head_dim, f"must be kv_lora_rank + rope dimensions, {C + R}")
        if c.get("value_length") not in (0, C):
            key.fail("attention.value_length", c.get("value_length"), f"must be kv_lora_rank, {C}")
        if c.get("k_mla") <= R:
            key.fail("attention.key_length_mla", c.get("k_mla"), f"must exceed the rope dimensions, {R}")
        G, Gu = c.get("groups"), c.get("groups_used")
        if G > 1 and (c.n_expert % G or c.n_expert // G < 2 or not 0 < Gu < G or c.n_expert_used > Gu * (c.n_expert // G)):
            key.fail("expert_group_count", G, f"must divide expert_count ({c.n_expert}) into groups of two or more, "
                     f"with 0 < expert_group_used_count ({Gu}) < it and the {c.n_expert_used} experts used "
                     "within the groups kept")
        if c.get("dense_lead") > c.n_layer:
            key.fail("leading_dense_block_count", c.get("dense_lead"), f"more than the {c.n_layer} layers")
        if c.rope_scaling == "yarn" and c.yarn[1:3] != (32.0, 1.0):
            key.fail("rope.scaling.yarn_beta_fast", c.yarn[1:3], "llama.cpp does not read YaRN's betas for "
                     "deepseek2 (it takes 32 and 1), so a file asking for others would answer differently there")

    def routed(self, c, i: int) -> bool:
        return i >= c.get("dense_lead", 0)

    def matrices(self, c, i):
        p = f"blk.{i}."
        mats = {"wkv_a": "attn_kv_a_mqa", "wk_b": "attn_k_b", "wv_b": "attn_v_b", "wo": "attn_output"}
        mats |= {"wq_a": "attn_q_a", "wq_b": "attn_q_b"} if c.get("q_lora_rank") else {"wq": "attn_q"}
        if self.routed(c, i):
            mats |= {"gate_exps": "ffn_gate_exps", "up_exps": "ffn_up_exps", "down_exps": "ffn_down_exps",
                     "router": "ffn_gate_inp", "gate_shexp": "ffn_gate_shexp", "up_shexp": "ffn_up_shexp",
                     "down_shexp": "ffn_down_shexp"}
        else:
            mats |= {"gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
        return {k: p + v + ".weight" for k, v in mats.items()}

    def vectors(self, c, i):
        p = f"blk.{i}."
        v = {"attn_norm": p + "attn_norm.weight", "ffn_norm": p + "ffn_norm.weight",
             "kv_a_norm": p + "attn_kv_a_norm.weight"}
        if c.get("q_lora_rank"):
            v["q_a_norm"] = p + "attn_q_a_norm.weight"
        if self.routed(c, i) and c.get("probs_b"):
            v["probs_b"] = p + "exp_probs_b.bias"
        return v

    def field_shapes(self, c, i, stored):
        E, H, R, C = c.n_embd, c.n_head, c.rope_dim, c.get("kv_lora_rank")
        nope, vd, qr = c.get("k_mla") - R, c.get("v_head"), c.get("q_lora_rank")
        out = super().field_shapes(c, i, stored)
        return out | {"wq": (H * (nope + R), E), "wq_a": (qr, E), "q_a_norm": (qr,), "wq_b": (H * (nope + R), qr),
                      "wkv_a": (C + R, E), "kv_a_norm": (C,), "wk_b": (H, C, nope), "wv_b": (H, vd, C),
                      "wo": (E, H * vd), "probs_b": (c.n_expert,)}

    def layer_weights(self, c, i: int, t: dict) -> Layer:
        attn = take(LatentAttention, t)
        if self.routed(c, i):
            ffn = DeepSeekMoE(router=t["router"], gate_exps=t["gate_exps"], up_exps=t["up_exps"],
                              down_exps=t["down_exps"], probs_b=t.get("probs_b"), gate_shexp=t["gate_shexp"],
                              up_shexp=t["up_shexp"], down_shexp=t["down_shexp"],
                              gating=SIGMOID if c.get("gating") == SIGMOID else SOFTMAX, groups=c.get("groups"),
                              groups_used=c.get("groups_used"), norm=c.expert_weights_norm,
                              scale=c.get("weights_scale"))
        else:
            ffn = take(FFN, t)
        return Layer(attn_norm=t["attn_norm"], attn=attn, ffn_norm=t["ffn_norm"], ffn=ffn)

    def rotated_key_start(self, c) -> int:
        return c.get("kv_lora_rank")               # the key row: compressed kv, then k_pe

    def yarn_attn_factor(self, c) -> float:
        """What llama.cpp hands the rope as its attention factor for deepseek2 (llama-context.cpp):
        mscale over mscale_all_dim (1 here), then the factor ggml's rope multiplies back in undone."""
        factor = F32(1) / (F32(1) / F32(c.rope_scale))
        log_mul = F32(c.get("yarn_log_mul"))
        base = F32(1) if log_mul != 0 else (F32(0.1) * _logf(factor) + F32(1) if factor > 1 else F32(1))
        return float(base * (F32(1) / (F32(1) + F32(0.1) * _logf(factor))) * F32(c.rope_attn_factor))

    def attention_scales(self, c) -> tuple[float, float]:
        """kq_scale = mscale² / sqrt(key_length_mla), mscale from the rope's factor (deepseek2.cpp)."""
        fs = F32(1) / F32(c.rope_scale) if c.rope_scaling != "none" else F32(1)
        attn = F32(self.yarn_attn_factor(c)) if c.rope_scaling == "yarn" else F32(c.rope_attn_factor)
        org = attn * (F32(1) + F32(0.1) * _logf(F32(1) / fs))
        mscale = org * (F32(1) + F32(0.1) * F32(c.get("yarn_log_mul")) * _logf(F32(1) / fs))
        return 0.0, float(F32(1) * mscale * mscale / np.sqrt(F32(c.get("k_mla"))))

    def facts(self, c) -> dict:
        return {"kv_lora_rank": c.get("kv_lora_rank"), "q_lora_rank": c.get("q_lora_rank"),
                "shared_experts": c.get("n_shared"), "leading_dense_layers": c.get("dense_lead")}
