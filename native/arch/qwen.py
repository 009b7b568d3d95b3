"""The Qwen 2 / 3 families and their MoE variants, and OLMoE — the llama skeleton with:

    qwen2      q/k/v biases                     qwen2moe   + biases, a sigmoid-gated shared expert
    qwen3      per-head q/k RMSNorm             qwen3moe   + per-head q/k norm, routed experts
    olmoe      q/k RMSNorm over the whole projection, routed experts
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blocks import rms_norm
from .base import Family
from .parts import Attention, BiasedAttention, NormedAttention


def _bias(i: int) -> dict[str, str]:
    return {f"b{x}": f"blk.{i}.attn_{x}.bias" for x in "qkv"}


def _qk_norm(i: int) -> dict[str, str]:
    return {"q_norm": f"blk.{i}.attn_q_norm.weight", "k_norm": f"blk.{i}.attn_k_norm.weight"}


@dataclass(kw_only=True)
class ProjectionNormedAttention(Attention):
    """q and k RMS-normed over the whole projection, before the heads are split (olmoe)."""
    q_norm: np.ndarray
    k_norm: np.ndarray

    def heads(self, c, q, k, v):
        return super().heads(c, rms_norm(q, self.q_norm, c.rms_eps), rms_norm(k, self.k_norm, c.rms_eps), v)


class Qwen2(Family):
    name, rope, norm_topk = "qwen2", "neox", False
    attention = BiasedAttention
    notes = "q/k/v biases, rotate-half rope"

    def vectors(self, c, i):
        return super().vectors(c, i) | _bias(i)


class Qwen2VL(Qwen2):
    """Qwen2-VL / Qwen2.5-VL's text model: qwen2 whose rope takes three positions a row (M-RoPE:
    time, height, width, each turning its section of a head's pairs). A text row's three are its
    one position — plain rope; an image's rows are placed by native/vision/mrope.py."""
    name = "qwen2vl"
    notes = "q/k/v biases, rotate-half M-RoPE (sections of time, height, width positions)"

    def hparams(self, key):
        sections = key("rope.dimension_sections", kind=None)
        if not isinstance(sections, (list, tuple, np.ndarray)) or len(sections) != 4 or not all(
                isinstance(s, (int, np.integer)) and 0 <= s <= 4096 for s in sections):
            key.fail("rope.dimension_sections", sections, "must be 4 section sizes (M-RoPE's t, h, w, e)")
        return {"rope_sections": tuple(int(s) for s in sections)}

    def check(self, c, key) -> None:
        super().check(c, key)
        self.check_sections(c, key)

    @staticmethod
    def check_sections(c, key) -> None:
        s = c.get("rope_sections")
        if not 0 < sum(s) <= c.rope_dim // 2:
            key.fail("rope.dimension_sections", list(s), f"must cover 1..{c.rope_dim // 2} of the rotated pairs")


class Qwen3(Family):
    name, rope, norm_topk = "qwen3", "neox", True
    notes = "per-head q/k RMSNorm"
    qk_norm = "head"
    attention = NormedAttention

    def vectors(self, c, i):
        return super().vectors(c, i) | _qk_norm(i)


class Qwen3VL(Qwen3):
    """Qwen3-VL's text model: qwen3 with interleaved M-RoPE (time, height, width taking turns over
    a head's pairs; the pairs past the sections turned by position 0 — on text too) and deepstack:
    an image row carries n_deepstack_layers more slices, added to the output of the first layers."""
    name = "qwen3vl"
    notes = "per-head q/k RMSNorm, interleaved M-RoPE, deepstack image slices"

    def hparams(self, key):
        return Qwen2VL.hparams(self, key) | {"rope_interleaved": True} | {
            "deepstack": key("n_deepstack_layers", 0, required=False, kind=int, lo=0, hi=4096)}

    def check(self, c, key) -> None:
        super().check(c, key)
        Qwen2VL.check_sections(c, key)
        if c.get("deepstack") > c.n_layer:
            key.fail("n_deepstack_layers", c.get("deepstack"), f"more than the model's {c.n_layer} layers")


class Qwen2Moe(Qwen2):
    name, moe, shared_expert = "qwen2moe", True, True
    notes = "q/k/v biases, routed experts plus a sigmoid-gated shared expert"

    def vectors(self, c, i):
        return super().vectors(c, i) | {"shared_gate": f"blk.{i}.ffn_gate_inp_shexp.weight"}


class Qwen3Moe(Qwen3):
    name, moe = "qwen3moe", True
    notes = "per-head q/k RMSNorm, routed experts"


class Olmoe(Family):
    name, rope, norm_topk, moe = "olmoe", "neox", False, True
    notes = "q/k RMSNorm over the whole projection, routed experts"
    qk_norm = "full"
    attention = ProjectionNormedAttention

    def vectors(self, c, i):
        return super().vectors(c, i) | _qk_norm(i)
