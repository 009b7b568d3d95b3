"""tests/data/tiny/tiny-smollm3.gguf and its llama.cpp reference: SmolLM3's layer (the llama skeleton
whose every fourth layer has no RoPE — llama.cpp's n_no_rope_layer_step 4), in the style of the
shared tiny models: tiny-llama's byte-level BPE vocabulary of 288 tokens and chat template, n_embd
128, 4 query heads and 2 KV heads of 32, FFN 256, 8 layers (two without RoPE), Q8_0 matrices, F32
norms, seeded random weights.

    python tests/tools/make_tiny_smollm3.py          # writes the model, then runs make_reference.py
"""

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"


def main() -> None:
    src = GGUFReader(TINY / "tiny-llama.gguf")
    field = lambda k: src.fields[k].contents()          # noqa: E731
    rng = np.random.default_rng(3)
    n_embd, n_layer, n_ff, n_head, n_kv, hd, vocab = 128, 8, 256, 4, 2, 32, 288
    out = TINY / "tiny-smollm3.gguf"
    w = GGUFWriter(str(out), "smollm3")
    w.add_name("tiny-smollm3")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_file_type(7)
    w.add_tokenizer_model(field("tokenizer.ggml.model"))
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(field("tokenizer.ggml.tokens"))
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(field("tokenizer.chat_template"))

    def mat(name, rows, cols, scale=0.08):
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        w.add_tensor(name, quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)

    def vec(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))
    mat("token_embd.weight", vocab, n_embd, 0.5)
    for i in range(n_layer):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_head * hd, n_embd)
        mat(p + "attn_k.weight", n_kv * hd, n_embd)
        mat(p + "attn_v.weight", n_kv * hd, n_embd)
        mat(p + "attn_output.weight", n_embd, n_head * hd)
        vec(p + "ffn_norm.weight", n_embd)
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff)
    vec("output_norm.weight", n_embd)
    mat("output.weight", vocab, n_embd, 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sys.path.insert(0, str(HERE / "tools"))
    import make_reference
    make_reference.tiny_reference(out, HERE / "data" / "prompts_tiny.json")


if __name__ == "__main__":
    main()
