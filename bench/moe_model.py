"""The random-weight Mixtral-style llama MoE bench/moe_stream.py streams: real GGUF layout
(blk.N.ffn_{gate,up,down}_exps in Q4_0, everything else F32/F16), the tokenizer of the tiny llama
reference, weights drawn from a fixed seed so every run reads the same file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FROM = ROOT / "tests" / "data" / "tiny" / "tiny-llama.gguf"


def q4_0_random(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """Random Q4_0 blocks (fp16 scale + 16 bytes of nibbles) for a (rows, cols) matrix."""
    nb = rows * cols // 32
    blocks = np.empty((nb, 18), np.uint8)
    blocks[:, :2] = np.full(nb, scale, np.float16).view(np.uint8).reshape(nb, 2)
    # nibbles 1..15, values q - 8 in -7..7: zero mean (0..15 would give every weight a -0.5 bias,
    # a common direction that grows through the layers until every token routes alike)
    lo, hi = rng.integers(1, 16, (2, nb, 16), dtype=np.uint8)
    blocks[:, 2:] = lo | (hi << 4)
    return blocks.reshape(rows, cols // 32 * 18)


def build_model(path: Path, layers: int, experts: int, used: int, embd: int, ff: int, seed: int = 0) -> Path:
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = GGUFReader(TOKENIZER_FROM)
    n_vocab = len(tok.fields["tokenizer.ggml.tokens"].contents())
    n_head = embd // 128                      # heads of 128 dimensions
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(tmp, "llama")
    w.add_string("general.name", f"synthetic MoE L{layers} E{experts}K{used}")
    for key, val in {"context_length": 2048, "embedding_length": embd, "block_count": layers,
                     "feed_forward_length": ff, "attention.head_count": n_head, "attention.head_count_kv": n_head,
                     "expert_count": experts, "expert_used_count": used}.items():
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in tok.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(key, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    plan = [("token_embd.weight", (n_vocab, embd), "q4"), ("output_norm.weight", (embd,), "norm")]
    for i in range(layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (embd,), "norm"), (p + "attn_q.weight", (embd, embd), "q4"),
                 (p + "attn_k.weight", (embd, embd), "q4"), (p + "attn_v.weight", (embd, embd), "q4"),
                 (p + "attn_output.weight", (embd, embd), "q4"), (p + "ffn_norm.weight", (embd,), "norm"),
                 (p + "ffn_gate_inp.weight", (experts, embd), "router"),
                 (p + "ffn_gate_exps.weight", (experts, ff, embd), "q4"),
                 (p + "ffn_up_exps.weight", (experts, ff, embd), "q4"),
                 (p + "ffn_down_exps.weight", (experts, embd, ff), "q4")]
    for name, shape, kind in plan:
        if kind == "q4":
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // 32 * 18), np.dtype(np.uint8),
                              int(np.prod(shape)) // 32 * 18, raw_dtype=Q.Q4_0)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in plan:
        if kind == "norm":
            data = np.ones(shape, np.float32)
        elif kind == "router":
            data = rng.normal(0, 1.0, shape).astype(np.float32)
        else:
            rows = int(np.prod(shape[:-1]))
            # weights of std ~1/sqrt(n_in) (a value q - 8 has std 4.3): the residual stream
            # stays in scale, so the router sees different inputs and picks different experts
            scale = 1.0 / (4.3 * np.sqrt(shape[-1]))
            data = q4_0_random(rng, rows, shape[-1], scale).reshape(*shape[:-1], -1)
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, path)
    return path
