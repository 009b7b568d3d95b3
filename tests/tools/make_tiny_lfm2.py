"""tests/data/tiny/tiny-lfm2.gguf and its llama.cpp reference: an LFM2 of 4 layers — short
convolutions in layers 0 and 2 (l_cache 3), attention in 1 and 3 (4 heads, 2 KV heads of 32,
per-head q/k norms) — 128 wide, FFN 256, tiny-llama's vocabulary, random F32 weights (seed 2),
the output tied to the embeddings. llama.cpp runs it through src/models/lfm2.cpp.

    python tests/tools/make_tiny_lfm2.py
"""

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"
KV_HEADS = [0, 2, 0, 2]


def main() -> None:
    sys.path.insert(0, str(HERE / "tools"))
    import make_reference
    rng = np.random.default_rng(2)
    E, H, D, F, L = 128, 4, 32, 256, 3
    src = GGUFReader(TINY / "tiny-llama.gguf")
    out = TINY / "tiny-lfm2.gguf"
    w = GGUFWriter(str(out), "lfm2")
    w.add_string("general.name", "tiny-lfm2")
    for k, f in src.fields.items():
        if k.startswith("tokenizer."):
            v = f.contents()
            if k == "tokenizer.ggml.token_type":
                w.add_token_types(v)
            elif f.types[0].name == "ARRAY":
                w.add_array(k, v)
            else:
                w.add_key_value(k, v, f.types[0])
    for k, v in (("block_count", 4), ("context_length", 2048), ("embedding_length", E), ("feed_forward_length", F),
                 ("attention.head_count", H), ("shortconv.l_cache", L), ("vocab_size", 288)):
        w.add_uint32(f"lfm2.{k}", v)
    w.add_array("lfm2.attention.head_count_kv", KV_HEADS)
    w.add_float32("lfm2.rope.freq_base", 1000000.0)
    w.add_float32("lfm2.attention.layer_norm_rms_epsilon", 1e-5)

    def mat(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32))

    def norm(name, n):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    w.add_tensor("token_embd.weight", (0.5 * rng.standard_normal((288, E))).astype(np.float32))
    norm("token_embd_norm.weight", E)
    for i, kv in enumerate(KV_HEADS):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", E)
        norm(p + "ffn_norm.weight", E)
        mat(p + "ffn_gate.weight", F, E)
        mat(p + "ffn_up.weight", F, E)
        mat(p + "ffn_down.weight", E, F)
        if kv == 0:
            mat(p + "shortconv.in_proj.weight", 3 * E, E)
            mat(p + "shortconv.out_proj.weight", E, E)
            w.add_tensor(p + "shortconv.conv.weight", (0.5 * rng.standard_normal((E, L))).astype(np.float32))
        else:
            mat(p + "attn_q.weight", H * D, E)
            mat(p + "attn_k.weight", kv * D, E)
            mat(p + "attn_v.weight", kv * D, E)
            mat(p + "attn_output.weight", E, H * D)
            norm(p + "attn_q_norm.weight", D)
            norm(p + "attn_k_norm.weight", D)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    make_reference.tiny_reference(out, HERE / "data" / "prompts_tiny.json")


if __name__ == "__main__":
    main()
