"""gpt-oss: the llama skeleton with attention biases and sinks (one logit per head in every
softmax's denominator), sliding-window attention on alternate layers (llama.cpp's pattern 2:
even layers), YaRN rope, the pre-FFN norm named post_attention_norm, and a biased MoE: router
logits + bias, the top-k logits softmaxed into weights, experts with biased gate/up/down and the
swiglu-oai activation (clamp(up, ±7) + 1) · g·sigmoid(1.702 g), g = min(gate, 7). Expert
weights are MXFP4."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blocks import apply_rope
from ..ggml_round import libm_expf
from ..kernels import matmul, matmul_many
from .base import MAX_CONTEXT, Family, check_window
from .parts import BiasedAttention, MoE, take

F32 = np.float32
ALPHA, LIMIT = F32(1.702), F32(7.0)


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml's swiglu_oai: x = min(gate, 7), y = clamp(up, -7, 7), x / (1 + expf(1.702·(−x))) · (y + 1)."""
    x = np.minimum(gate, LIMIT)
    y = np.clip(up, -LIMIT, LIMIT)
    return (x / (F32(1) + libm_expf(ALPHA * -x))) * (y + F32(1))


def softmax_c(x: np.ndarray) -> np.ndarray:
    """A softmax over a handful of values as ggml's scalar path: max, expf, the sum in double."""
    e = libm_expf(x - x.max(axis=-1, keepdims=True))
    return e * (1.0 / e.astype(np.float64).sum(axis=-1, keepdims=True)).astype(F32)


@dataclass(kw_only=True)
class SinkAttention(BiasedAttention):
    """Biased q, k, v and output; a sink logit per head in every softmax's denominator."""
    bo: np.ndarray
    sinks: np.ndarray

    def __call__(self, i, x, b):
        c = b.config
        T = x.shape[0]
        q, k, v = b.project_many(x, (self.wq, self.wk, self.wv))      # an adapter's deltas, then the biases
        q = apply_rope(np.ascontiguousarray((q + self.bq).reshape(T, c.n_head, c.head_dim)), b.cos, b.sin, c.rope_style)
        k = apply_rope(np.ascontiguousarray((k + self.bk).reshape(T, c.n_head_kv, c.head_dim)), b.cos, b.sin,
                       c.rope_style)
        v = (v + self.bv).reshape(T, c.n_head_kv, c.head_dim)
        return b.project(b.attend(i, q, k, v, None, self.window, self.sinks), self.wo) + self.bo


@dataclass(kw_only=True)
class BiasedMoE(MoE):
    """Router logits + bias; the top-k logits softmaxed into weights; experts with biased
    gate/up/down and the swiglu-oai activation, summed slot by slot in the chosen order."""
    router_b: np.ndarray
    gate_b: np.ndarray
    up_b: np.ndarray
    down_b: np.ndarray

    def __call__(self, i, x, b):
        c = b.config
        logits = matmul(x, self.router) + self.router_b                               # (T, E)
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :c.n_expert_used]        # chosen by logit
        weights = softmax_c(np.take_along_axis(logits, top, axis=-1))
        b.experts.prefetch(i, np.unique(top), rows=len(x))
        per_slot = np.empty((x.shape[0], top.shape[1], x.shape[1]), F32)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            gate, up, down = b.experts.weights(i, self, int(e))
            xs = x[rows]
            g, u = matmul_many(xs, [gate, up]) if gate.qtype == up.qtype else (matmul(xs, gate), matmul(xs, up))
            h = swiglu_oai(g + self.gate_b[e], u + self.up_b[e])
            per_slot[rows, slot] = weights[rows, slot, None] * (matmul(h, down) + self.down_b[e])
        out = per_slot[:, 0].copy()
        for j in range(1, top.shape[1]):          # summed slot by slot, in the chosen (logit) order, as ggml
            out += per_slot[:, j]
        return out


class GptOss(Family):
    name, aliases, rope, moe = "gpt-oss", ("gpt_oss",), "neox", True
    attention = SinkAttention                    # in the llama skeleton, with BiasedMoE for its FFN
    notes = ("attention sinks, biased q/k/v/o, alternate sliding-window layers, YaRN rope, biased MoE with "
             "softmax over the chosen logits and the swiglu-oai activation, MXFP4 expert weights")

    def hparams(self, key) -> dict:
        return {"sliding_window": key("attention.sliding_window", 0, required=False, kind=int, lo=0, hi=MAX_CONTEXT)}

    def check(self, c, key) -> None:
        super().check(c, key)
        check_window(c, key)

    def field_shapes(self, c, i, stored):
        X, fe = c.n_expert, stored(f"blk.{i}.ffn_gate_exps.weight", 1)
        return super().field_shapes(c, i, stored) | {
            "sinks": (c.n_head,), "router_b": (X,), "gate_b": (X, fe), "up_b": (X, fe), "down_b": (X, c.n_embd)}

    def sliding(self, c, i: int) -> bool:
        return bool(c.get("sliding_window")) and i % 2 == 0

    def matrices(self, c, i):
        p = f"blk.{i}."
        return {k: p + v + ".weight" for k, v in {
            "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "router": "ffn_gate_inp",
            "gate_exps": "ffn_gate_exps", "up_exps": "ffn_up_exps", "down_exps": "ffn_down_exps"}.items()}

    def vectors(self, c, i):
        p = f"blk.{i}."
        return {"attn_norm": p + "attn_norm.weight", "ffn_norm": p + "post_attention_norm.weight",
                "bq": p + "attn_q.bias", "bk": p + "attn_k.bias", "bv": p + "attn_v.bias", "bo": p + "attn_output.bias",
                "sinks": p + "attn_sinks.weight", "router_b": p + "ffn_gate_inp.bias",
                "gate_b": p + "ffn_gate_exps.bias", "up_b": p + "ffn_up_exps.bias", "down_b": p + "ffn_down_exps.bias"}

    def facts(self, c) -> dict:
        return {"sliding_window": c.get("sliding_window"),
                "sliding_layers": sum(self.sliding(c, i) for i in range(c.n_layer)),
                "rope_scaling": c.rope_scaling, "rope_factor": c.rope_scale}

    def ffn_weights(self, c, i, t):
        return take(BiasedMoE, t)
