"""ernie4_5 (ERNIE 4.5 0.3B, the dense one): the llama skeleton — RMSNorm, SwiGLU, GQA, rope on
adjacent pairs — as llama.cpp runs it (src/models/ernie4-5.cpp). What its loader also allows and
Kiln does not compute is refused by name: an attention output bias, PaddleOCR's multi-section
rope."""

from __future__ import annotations

from ..gguf_file import GGUFError
from .llama import Llama


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
