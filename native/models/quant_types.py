"""Which type each tensor gets when a model is quantized: llama.cpp's rules (src/llama-quant.cpp of
the llama.cpp that llama-cpp-python 0.3.36 vendors), for the file types Kiln writes.

A file type names a mixture, not one type: Q4_K_M keeps the output head in Q6_K and gives Q6_K to
the value projections and FFN down-projections of the first and last eighth of the layers and of
every third layer between; a tensor whose rows do not divide into the type's blocks falls back to a
32-value type. The rules count tensors in llama.cpp's order (by layer number, then by name), so the
order is part of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

# name -> (llama.cpp's llama_ftype id, the type most tensors get)
FILE_TYPES: dict[str, tuple[int, Q]] = {
    "Q4_0": (2, Q.Q4_0), "Q4_1": (3, Q.Q4_1), "Q8_0": (7, Q.Q8_0), "Q5_0": (8, Q.Q5_0), "Q5_1": (9, Q.Q5_1),
    "Q4_K_S": (14, Q.Q4_K), "Q4_K_M": (15, Q.Q4_K), "Q5_K_S": (16, Q.Q5_K), "Q5_K_M": (17, Q.Q5_K),
    "Q6_K": (18, Q.Q6_K),
}
SOURCE_TYPES = (Q.F32, Q.F16, Q.BF16)          # what is converted; quantized tensors are not requantized

_BLK = re.compile(r"blk\.\s*([+-]?\d+)")         # sscanf(name, "blk.%d.")
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                  "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
                  "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
                  "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
                  "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
                  "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
                  "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd",
                  "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook",
                  "mm.a.code_embd")


class QuantizeError(ValueError):
    """A model that cannot be quantized as asked; the message says why and what to do."""


def block_layer(name: str) -> int:
    m = _BLK.match(name)
    return int(m.group(1)) if m else -1


def llama_order(names) -> list[str]:
    """llama.cpp's tensor order when it quantizes (its loader's weights map): by layer number,
    tensors outside the layers first, then by name."""
    return sorted(names, key=lambda n: (block_layer(n), n.encode()))


def n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count."""
    for i in range(len(ne) - 1, 0, -1):
        if ne[i] > 1:
            return i + 1
    return 1


def category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                      ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                      ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


def allows_quantization(name: str, ne: tuple[int, ...]) -> bool:
    if n_dims(ne) < 2 or not name.endswith("weight"):
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(part in name for part in _NOT_QUANTIZED)


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class Model:
    """What the rules read from the file's metadata (llama.cpp's hparams)."""
    arch: str
    n_layer: int
    n_expert: int = 0
    is_70b: bool = False


@dataclass
class Mixture:
    """The counting state of one quantization (llama.cpp's quantize_state_impl)."""
    model: Model
    ftype: str
    n_attention_wv: int = 0
    tied: bool = True
    i_attention_wv: int = 0
    i_ffn: dict = field(default_factory=lambda: {"ffn_down": 0, "ffn_gate": 0, "ffn_up": 0})
    fallbacks: list = field(default_factory=list)

    @classmethod
    def start(cls, model: Model, ftype: str, names) -> "Mixture":
        mix = cls(model, ftype)
        for name in names:
            cat = category(name)
            mix.n_attention_wv += cat in ("attn_v", "attn_qkv", "attn_kv_b")
            mix.tied &= cat != "output"
        return mix

    def layer(self, cat: str, name: str) -> tuple[int, int]:
        i, n = self.i_ffn[cat], self.model.n_layer
        if self.model.n_expert > 1:       # experts' tensors are not in layer order: the layer from the name
            if not _BLK.match(name):
                raise QuantizeError(f"tensor {name!r}: no layer number in its name (blk.N.)")
            i = block_layer(name)
            if not 0 <= i < n:
                raise QuantizeError(f"tensor {name!r}: layer {i} outside the model's {n} layers")
        return i, n

    def type_of(self, name: str, ne: tuple[int, ...], default: Q) -> Q:
        """The type llama.cpp gives tensor `name` (one that allows quantization), counting it."""
        t = self._mixture(name, ne, default)
        block = GGML_QUANT_SIZES[t][0]
        if ne[0] % block:
            fallback = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}.get(t, t)
            if ne[0] % GGML_QUANT_SIZES[fallback][0]:
                fallback = Q.F16
            self.fallbacks.append((name, t, fallback))
            t = fallback
        return t

    def _mixture(self, name: str, ne: tuple[int, ...], t: Q) -> Q:
        cat, ft, m = category(name), self.ftype, self.model
        falcon = m.arch == "falcon"
        if cat == "output" or (self.tied and cat == "token_embd"):
            if falcon or ne[0] % GGML_QUANT_SIZES[t][0]:
                return Q.Q8_0
            return Q.Q6_K if t != Q.Q8_0 else t
        if cat == "token_embd":
            return t
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(self.i_attention_wv, self.n_attention_wv):
                t = Q.Q6_K
            elif ft == "Q4_K_S" and self.i_attention_wv < 4:
                t = Q.Q5_K
            if m.is_70b and t in (Q.Q3_K, Q.Q4_K):
                t = Q.Q5_K
            if m.n_expert == 8:
                t = Q.Q8_0
            self.i_attention_wv += 1
            return t
        if cat == "attn_k":
            return Q.Q8_0 if m.n_expert == 8 else t
        if cat == "ffn_down":
            i, n = self.layer(cat, name)
            if ft == "Q4_K_M":
                if falcon:
                    t = Q.Q6_K if i < n // 16 else Q.Q5_K if use_more_bits(i, n) else Q.Q4_K
                elif use_more_bits(i, n):
                    t = Q.Q6_K
            elif ft == "Q5_K_M" and use_more_bits(i, n):
                t = Q.Q6_K
            elif ft == "Q4_K_S" and not falcon and i < n // 8:
                t = Q.Q5_K
            self.i_ffn[cat] += 1
            return t
        if cat == "attn_output":
            if not falcon and m.n_expert == 8 and ft in ("Q4_K_S", "Q4_K_M"):
                t = Q.Q5_K
            return t
        if cat in ("ffn_gate", "ffn_up"):
            self.layer(cat, name)
            self.i_ffn[cat] += 1
        return t


def model_of(metadata: dict) -> Model:
    """The hparams the rules read: architecture, layer count, experts, and whether llama.cpp
    calls the model a 70B (its value projections get more bits)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise QuantizeError("the file names no architecture (general.architecture); it is not a model")
    n_layer = metadata.get(f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer < 1:
        raise QuantizeError(f"the file has no {arch}.block_count; it is not a complete {arch} model")
    n_expert = metadata.get(f"{arch}.expert_count", 0)
    n_expert = n_expert if isinstance(n_expert, int) else 0

    def first(v):
        return int(v[0]) if hasattr(v, "__len__") and len(v) else v
    n_head = first(metadata.get(f"{arch}.attention.head_count", 0))
    n_head_kv = first(metadata.get(f"{arch}.attention.head_count_kv", n_head))
    is_70b = ((arch == "llama" and n_layer == 80 and n_head != n_head_kv)
              or (arch in ("qwen2", "deci", "olmo") and n_layer == 80) or (arch == "jais2" and n_layer == 68))
    return Model(arch, n_layer, n_expert, is_70b)
