"""Tiny unquantized models for the quantizer's tests: random weights of shapes that reach every
rule of llama.cpp's type mixture (tied and untied heads, rows that K-quants cannot hold, eight
experts, ten layers so the first and last eighths and every third layer differ)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _store(a: np.ndarray, dtype: str) -> tuple[np.ndarray, object]:
    from gguf import GGMLQuantizationType as Q
    if a.ndim == 1 or dtype == "F32":
        return a.astype(np.float32), None
    if dtype == "F16":
        return a.astype(np.float16), None
    bits = a.astype(np.float32).view(np.uint32)
    bf = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)      # round to nearest even
    return bf, Q.BF16


def _hparams(w, name: str, n_embd: int, n_layer: int, n_ff: int, hd: int, dtype: str, experts=None) -> None:
    """The metadata both models share, in the order the recorded inputs were written."""
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    if experts:
        w.add_expert_feed_forward_length(experts[0])
        w.add_expert_count(experts[1])
        w.add_expert_used_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type({"F32": 0, "F16": 1, "BF16": 32}[dtype])


def write_dense(path: Path, dtype: str = "F16", *, n_embd: int = 256, n_layer: int = 10, n_ff: int = 512,
                vocab: int = 300, tied: bool = True, arch: str = "llama", seed: int = 0) -> Path:
    """A llama-shaped model (arch llama or qwen3: q/k norms)."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    n_head, n_kv, hd = 4, 2, n_embd // 4
    _hparams(w, f"tiny {arch} for the quantizer", n_embd, n_layer, n_ff, hd, dtype)
    w.add_string("general.quantized_by", "nobody: the file_type key above is moved to the end")

    def t(name, *shape, scale=0.02):
        a = rng.standard_normal(shape).astype(np.float32) * scale
        if len(shape) > 1:
            a[0, :8] = 0.0                                           # an all-zero block: scale searches skip it
        arr, raw = _store(a, dtype)
        w.add_tensor(name, arr, raw_dtype=raw)

    t("token_embd.weight", vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    if not tied:
        t("output.weight", vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        t(p + "attn_q.weight", n_head * hd, n_embd)
        t(p + "attn_k.weight", n_kv * hd, n_embd)
        t(p + "attn_v.weight", n_kv * hd, n_embd)
        t(p + "attn_output.weight", n_embd, n_head * hd)
        if arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(hd, np.float32))
        t(p + "ffn_gate.weight", n_ff, n_embd)
        t(p + "ffn_up.weight", n_ff, n_embd)
        t(p + "ffn_down.weight", n_embd, n_ff, scale=2.0)       # another magnitude: other scale searches
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_moe(path: Path, dtype: str = "F32", *, n_embd: int = 320, n_layer: int = 3, n_expert: int = 8,
              n_ff_exp: int = 96, vocab: int = 256, seed: int = 1) -> Path:
    """A qwen3moe-shaped model with eight experts (llama.cpp's eight-expert rules) and an untied
    head; 320-wide rows fall back from K-quants to 32-value types."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    n_head, n_kv, hd = 4, 2, 64
    _hparams(w, "tiny qwen3moe for the quantizer", n_embd, n_layer, n_ff_exp, hd, dtype, experts=(n_ff_exp, n_expert))

    def t(name, *shape):
        arr, raw = _store(rng.standard_normal(shape).astype(np.float32) * 0.05, dtype)
        w.add_tensor(name, arr, raw_dtype=raw)

    t("token_embd.weight", vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    t("output.weight", vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", np.ones(n_embd, np.float32))
        for n in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(p + n + ".weight", np.ones(hd, np.float32))
        t(p + "attn_q.weight", n_head * hd, n_embd)
        t(p + "attn_k.weight", n_kv * hd, n_embd)
        t(p + "attn_v.weight", n_kv * hd, n_embd)
        t(p + "attn_output.weight", n_embd, n_head * hd)
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((n_expert, n_embd)).astype(np.float32))
        t(p + "ffn_gate_exps.weight", n_expert, n_ff_exp, n_embd)
        t(p + "ffn_up_exps.weight", n_expert, n_ff_exp, n_embd)
        t(p + "ffn_down_exps.weight", n_expert, n_embd, n_ff_exp)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_quantize(src: Path, dst: Path, file_type: str, threads: int = 2) -> None:
    """llama.cpp's own quantizer, through llama-cpp-python."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed on {src} -> {file_type}")


# the quantizer's test inputs by name (tests/data/quantize.json holds llama.cpp's outputs' hashes)
INPUTS = {
    "llama-f16-tied": lambda p: write_dense(p, "F16"),
    "qwen3moe-f32-e8": lambda p: write_moe(p, "F32"),
    "qwen3-bf16-untied": lambda p: write_dense(p, "BF16", arch="qwen3", tied=False, n_layer=17, n_ff=256),
}
