"""llama, mistral (SmolLM2, Llama 1–3.x, Mistral; Mixtral-style MoE when the file has experts).

Llama 3.1+ files carry `rope_freqs.weight`: one factor per rotated pair, and ggml divides the
pair's rotation angle by it (Llama 3's long-context frequency scaling)."""

from __future__ import annotations

from .base import Family


class Llama(Family):
    name = "llama"
    aliases = ("mistral",)
    rope = "normal"
    norm_topk = True
    notes = "RMSNorm, SwiGLU, GQA, rope on adjacent pairs; rope_freqs factors (Llama 3.1+); Mixtral-style MoE"

    def needs(self, c, g) -> str:
        # SmolLM2 is neither a Llama 3.1 nor a Mixtral: say only what this file has
        out = "RMSNorm, SwiGLU, GQA, rope on adjacent pairs"
        if "rope_freqs.weight" in g.tensors:
            out += "; rope_freqs factors (Llama 3.1+)"
        if c.is_moe:
            out += "; Mixtral-style MoE"
        return out

    def model_tensors(self, g) -> dict[str, str]:
        return {"rope_freqs": "rope_freqs.weight"} if "rope_freqs.weight" in g.tensors else {}
