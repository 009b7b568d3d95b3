"""ernie4_5 (ERNIE 4.5 0.3B, the dense one) and ernie4_5-moe. The dense one: the llama skeleton — RMSNorm, SwiGLU, GQA, rope on
adjacent pairs — as llama.cpp runs it (src/models/ernie4-5.cpp). What its loader also allows and
Kiln does not compute is refused by name: an attention output bias, PaddleOCR's multi-section
rope."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ggml_round
from ..blocks import route, swiglu_ffn
from ..gguf_file import GGUFError
from ..kernels import Weight
from .base import MAX_LAYERS, MAX_WIDTH
from .llama import Llama
from .parts import FFN, MoE, take

F32 = np.float32


class Ernie45(Llama):
    name = "ernie4_5"
    aliases = ()
    notes = "the llama skeleton (RMSNorm, SwiGLU, GQA, rope on adjacent pairs), as llama.cpp runs ERNIE 4.5 dense"

    def needs(self, c, g) -> str:
        return "RMSNorm, SwiGLU, GQA, rope on adjacent pairs (the llama skeleton)"

    def check(self, c, key) -> None:
        super().check(c, key)
        if key("rope.dimension_sections", None, required=False) is not None:
            key.fail("rope.dimension_sections", key("rope.dimension_sections", None, required=False),
                     "multi-section rope (PaddleOCR's) is not supported")
        g = key.g
        for i in range(c.n_layer):
            for t in ("attn_output.bias", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_qkv.weight"):
                if f"blk.{i}.{t}" in g.tensors:
                    raise GGUFError(f"{g.path}: tensor 'blk.{i}.{t}': an ERNIE 4.5 variant Kiln does not run yet "
                                    f"(biases or a fused q|k|v); ERNIE 4.5 0.3B has none")


@dataclass(kw_only=True)
class ErnieMoE(MoE):
    """ERNIE 4.5's routed experts (llama.cpp's build_moe_ffn as ernie4-5-moe.cpp calls it): the
    router's softmax; the top k chosen on it plus a per-expert selection bias (exp_probs_b, where
    the file has one) but weighted by the unbiased probabilities, those renormalised to sum 1
    (the sum in double, clamped at fp16's smallest normal); a shared expert (SwiGLU, ungated)
    added when the file has one."""
    probs_b: np.ndarray | None = None
    gate_shexp: Weight | None = None
    up_shexp: Weight | None = None
    down_shexp: Weight | None = None

    def rule(self) -> tuple:
        """The routing as the compiled kernels take it (csrc/layer.h RouteRule): the selection bias."""
        return self.probs_b, False, 0, 0, 0.0

    def choose(self, probs: np.ndarray, k: int, norm: bool = True, scale: float = 0.0) -> tuple:
        """The numpy form of the rule (without the compiled kernels): the top k of probs (+ the
        selection bias), weighed by probs, renormalised, scaled, in ascending expert order."""
        pick = probs + self.probs_b if self.probs_b is not None else probs
        pick = self.keep_groups(pick)
        top = np.argsort(-pick, axis=-1, kind="stable")[:, :k]          # argsort_top_k
        w = np.take_along_axis(probs, top, axis=-1)
        if norm:
            total = np.maximum(np.cumsum(w, axis=-1, dtype=np.float64)[:, -1:].astype(F32), F32(6.103515625e-5))
            w = (w / total).astype(F32)
        if scale not in (0.0, 1.0):
            w = (w * F32(scale)).astype(F32)
        order = np.argsort(top, axis=-1, kind="stable")          # the experts' outputs summed in ascending order
        return np.take_along_axis(top, order, -1), np.take_along_axis(w, order, -1)

    def keep_groups(self, pick: np.ndarray) -> np.ndarray:
        return pick

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        k = b.config.n_expert_used
        experts, weights = route(x, self.router, k, True, self.rule(),
                                 lambda logits: self.choose(ggml_round.softmax(logits), k))
        residual, b.residual = b.residual, None
        out = b.experts.ffn(i, self, x, experts, weights, residual)
        if self.gate_shexp is not None:
            out = out + swiglu_ffn(x, self.gate_shexp, self.up_shexp, self.down_shexp, b.mm)
        return out


class Ernie45Moe(Ernie45):
    """ernie4_5-moe (ERNIE 4.5 21B-A3B, 300B-A47B): the dense skeleton's attention; the first
    leading_dense_block_count layers a dense SwiGLU, the rest ErnieMoE (interleave step 1: llama.cpp
    loads expert tensors for every layer after the dense ones)."""
    name = "ernie4_5-moe"
    moe = True
    notes = ("the llama skeleton's attention; leading dense layers, then routed experts (softmax, a selection "
             "bias, renormalised and scaled weights) with an ungated shared expert")

    def needs(self, c, g) -> str:
        return self.notes

    def hparams(self, key) -> dict:
        g = key.g
        return {"dense_lead": key("leading_dense_block_count", 0, required=False, kind=int, lo=0, hi=MAX_LAYERS),
                "moe_step": key("interleave_moe_layer_step", kind=int, lo=1, hi=MAX_LAYERS),
                "n_ff_shexp": key("expert_shared_feed_forward_length", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
                "weights_scale": key("expert_weights_scale", 0.0, required=False, kind=float),
                "probs_b": any(n.endswith(".exp_probs_b.bias") for n in g.tensors)}

    def check(self, c, key) -> None:
        super().check(c, key)
        if c.get("moe_step") != 1:
            key.fail("interleave_moe_layer_step", c.get("moe_step"), "llama.cpp runs only 1 (every layer after the "
                     "dense ones has experts; another step builds dense layers from tensors it does not load)")
        if c.get("weights_scale") not in (0.0, 1.0):      # llama.cpp does not read it for ERNIE 4.5
            key.fail("expert_weights_scale", c.get("weights_scale"), "llama.cpp does not scale ERNIE 4.5's expert "
                     "weights, so a file asking for it would answer differently there; Kiln refuses it")
        if c.get("dense_lead") > c.n_layer:
            key.fail("leading_dense_block_count", c.get("dense_lead"), f"more than the {c.n_layer} layers")

    def routed(self, c, i: int) -> bool:
        return i >= c.get("dense_lead", 0)

    def matrices(self, c, i):
        p = f"blk.{i}."
        mats = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output"}
        if self.routed(c, i):
            mats |= {"gate_exps": "ffn_gate_exps", "up_exps": "ffn_up_exps", "down_exps": "ffn_down_exps",
                     "router": "ffn_gate_inp"}
            if c.get("n_ff_shexp"):
                mats |= {"gate_shexp": "ffn_gate_shexp", "up_shexp": "ffn_up_shexp", "down_shexp": "ffn_down_shexp"}
        else:
            mats |= {"gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
        return {k: p + v + ".weight" for k, v in mats.items()}

    def vectors(self, c, i):
        v = super().vectors(c, i)
        return v | ({"probs_b": f"blk.{i}.exp_probs_b.bias"} if self.routed(c, i) and c.get("probs_b") else {})

    def field_shapes(self, c, i, stored):
        return super().field_shapes(c, i, stored) | {"probs_b": (c.n_expert,)}

    def ffn_weights(self, c, i, t):
        if not self.routed(c, i):
            return take(FFN, t)
        shared = {k: t[k] for k in ("gate_shexp", "up_shexp", "down_shexp") if k in t}
        return ErnieMoE(router=t["router"], gate_exps=t["gate_exps"], up_exps=t["up_exps"], down_exps=t["down_exps"],
                        probs_b=t.get("probs_b"), **shared)
