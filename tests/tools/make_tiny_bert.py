"""tests/data/tiny/tiny-bert.gguf, tiny-bert-rerank.gguf and their llama.cpp reference: BERT's
encoder as llama.cpp's `bert` architecture reads it (src/models/bert.cpp) — learned positions,
token types, LayerNorms with biases, GELU FFN, bidirectional attention — with a WordPiece
vocabulary in llama.cpp's phantom-space form (a word's first piece "▁the", a continuation "ing",
as convert_hf_to_gguf writes BERT's "##ing"), lowercasing and accent stripping on. The embedder
pools by mean (its file says so) and is asked for every pooling; the reranker adds the
classification head (cls, cls.output) and pools by rank, as bge-reranker's conversion does.
tiny-nomic-bert.gguf is nomic-embed's layer on the same vocabulary (rotary positions, a fused
q|k|v, a SwiGLU FFN), tiny-jina-bert-v2.gguf jina-embeddings-v2's (ALiBi, q/k LayerNorms, a
GELU-gated FFN), tiny-modern-bert.gguf ModernBERT's (pre-norm, no biases, rotary positions with
local layers of their own base and a symmetric window of 8, GELU-gated): their embeddings go in
tiny-bert.npz as nomic_/jina_/modern_<pooling>_<i>.

n_embd 64, 4 heads, FFN 256, 3 layers, 128 positions, seeded random weights (Q8_0 matrices in the
reranker, F16 in the embedder). The reference is llama-cpp-python's `embed` (embedding=True),
one text at a time, not normalised; the reranker's inputs are llama-server's rerank prompt
([CLS] query [SEP] document, format_prompt_rerank).

    python tests/tools/make_tiny_bert.py
"""

import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-:;()\"$+<=>"
WORDS = ("the cat sat on mat dog runs run jump quick brown fox over lazy hello world paris france capital of is "
         "what machine learning model embed search rank query document kiln fire clay pottery bake oven hot "
         "a an and to in it for with cafe 中 文 where how many people live city river bread water").split()
SUFFIXES = ["ing", "ed", "s", "ly", "er", "tion", "ation", "est"]

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paris is the capital of France, a city on the river.",
    "Kiln bakes CLAY pottery in a hot oven!",
    "  spaces\tand\nnewlines   between   words  ",
    "Café au lait costs $3.50 (plus tax)",
    "中文 text with 中 characters",
    "an unknown glyph: ж and emoji 🙂 here",
    "machine learning models embed documents for search and ranking",
    "[CLS] markup typed by a user stays text [SEP]",
    " ".join(["the cat sat on the mat"] * 12),
]
PAIRS = [("what is the capital of france?", ["Paris is the capital of France.", "The cat sat on the mat.",
                                             "Bread is baked in a hot oven.", "France"]),
         ("how do you bake clay pottery", ["Kiln fire bakes clay pottery.", "a quick brown fox",
                                           "people live in the city by the river"])]
POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = list(SPECIALS)
    for c in CHARS:
        tokens += ["▁" + c, c]
    tokens += ["▁" + w for w in WORDS if "▁" + w not in tokens]
    tokens += [s for s in SUFFIXES if s not in tokens]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, types


def write(path: Path, *, rank: bool, seed: int, arch: str = "bert") -> None:
    tokens, types = vocabulary()
    write_bert(path, tokens, types, rank=rank, seed=seed, qt=Q.F16, arch=arch)


def write_bert(path: Path, tokens: list[str], types: list[int], *, rank: bool, seed: int, qt,
               n_embd: int = 64, n_head: int = 4, n_ff: int = 256, n_layer: int = 3, n_ctx: int = 128,
               arch: str = "bert", vocab=None) -> None:
    """A BERT GGUF of this shape with seeded random weights (also bench/embeddings.py's); `arch`
    "nomic-bert": nomic-embed's layer instead — rotary positions (neox, base 1000), a fused
    q|k|v with its bias, a SwiGLU FFN without biases, no position table. `vocab(writer)`: writes
    the tokenizer's metadata in place of the WordPiece one (make_tiny_xlmr.py's unigram)."""
    rng = np.random.default_rng(seed)
    nomic, jina, modern = arch == "nomic-bert", arch == "jina-bert-v2", arch == "modern-bert"
    w = GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_uint32(f"{arch}.pooling_type", POOLING["rank" if rank else "mean"])
    if nomic:
        w.add_rope_freq_base(1000.0)
    if modern:                          # local layers (1 and 2 of 3) see 4 positions each side
        w.add_rope_freq_base(160000.0)
        w.add_float32("modern-bert.rope.freq_base_swa", 10000.0)
        w.add_uint32("modern-bert.attention.sliding_window", 8)
    w.add_file_type({Q.F32: 0, Q.F16: 1, Q.Q8_0: 7}[qt])
    if vocab is not None:
        vocab(w)
    else:
        w.add_tokenizer_model("bert")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_type_count(2)
        w.add_bos_token_id(2)           # [CLS]
        w.add_sep_token_id(3)
        w.add_unk_token_id(1)
        w.add_pad_token_id(0)
        w.add_mask_token_id(4)
        w.add_bool("tokenizer.ggml.normalizer.lowercase", True)

    def mat(name, rows, cols, scale=0.1):
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if qt in (Q.F16, Q.F32):
            w.add_tensor(name, a.astype(np.float16 if qt == Q.F16 else np.float32))
        else:
            w.add_tensor(name, quantize(a, qt), raw_dtype=qt)

    def vec(name, n, mean=0.0, scale=0.05):
        w.add_tensor(name, (mean + scale * rng.standard_normal(n)).astype(np.float32))
    def head(norm: bool) -> None:
        """The rank head: cls (then its norm, modern-bert's, or its bias), one score's cls.output."""
        w.add_tensor("cls.weight", (rng.standard_normal((n_embd, n_embd)) * 0.2).astype(np.float32))
        vec("cls.norm.weight", n_embd, 1.0, 0.1) if norm else vec("cls.bias", n_embd)
        w.add_tensor("cls.output.weight", (rng.standard_normal((1, n_embd)) * 0.5).astype(np.float32))
        vec("cls.output.bias", 1)

    def finish() -> None:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    w.add_tensor("token_embd.weight", (rng.standard_normal((len(tokens), n_embd)) * 0.5).astype(np.float32))
    if modern:                          # pre-norm, no biases, a GELU-gated up, a final norm
        vec("token_embd_norm.weight", n_embd, 1.0, 0.1)
        for i in range(n_layer):
            p = f"blk.{i}."
            if i:
                vec(p + "attn_norm.weight", n_embd, 1.0, 0.1)
            mat(p + "attn_qkv.weight", 3 * n_embd, n_embd)
            mat(p + "attn_output.weight", n_embd, n_embd)
            vec(p + "ffn_norm.weight", n_embd, 1.0, 0.1)
            mat(p + "ffn_up.weight", 2 * n_ff, n_embd)
            mat(p + "ffn_down.weight", n_embd, n_ff)
        vec("output_norm.weight", n_embd, 1.0, 0.1)
        if rank:                        # mean-pooled, dense, GELU, a head norm, one score
            head(norm=True)
        finish()
        return
    w.add_tensor("token_types.weight", (rng.standard_normal((1 if vocab else 2, n_embd)) * 0.1).astype(np.float32))
    if not (nomic or jina):
        w.add_tensor("position_embd.weight", (rng.standard_normal((n_ctx, n_embd)) * 0.1).astype(np.float32))
    vec("token_embd_norm.weight", n_embd, 1.0, 0.1)
    vec("token_embd_norm.bias", n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        if jina:                       # ALiBi, q/k LayerNorms, the gate fused into up (2 × FFN rows)
            for t in ("attn_q", "attn_k", "attn_v"):
                mat(p + t + ".weight", n_embd, n_embd)
                vec(p + t + ".bias", n_embd)
            for t in ("attn_q_norm", "attn_k_norm"):
                vec(p + t + ".weight", n_embd, 1.0, 0.1)
                vec(p + t + ".bias", n_embd)
            mat(p + "attn_output.weight", n_embd, n_embd)
            vec(p + "attn_output.bias", n_embd)
            vec(p + "attn_output_norm.weight", n_embd, 1.0, 0.1)
            vec(p + "attn_output_norm.bias", n_embd)
            mat(p + "ffn_up.weight", 2 * n_ff, n_embd)
            mat(p + "ffn_down.weight", n_embd, n_ff)
            vec(p + "ffn_down.bias", n_embd)
            vec(p + "layer_output_norm.weight", n_embd, 1.0, 0.1)
            vec(p + "layer_output_norm.bias", n_embd)
            continue
        if nomic:
            mat(p + "attn_qkv.weight", 3 * n_embd, n_embd)
            vec(p + "attn_qkv.bias", 3 * n_embd)
            mat(p + "attn_output.weight", n_embd, n_embd)
            vec(p + "attn_output_norm.weight", n_embd, 1.0, 0.1)
            vec(p + "attn_output_norm.bias", n_embd)
            for t in ("ffn_up", "ffn_gate"):
                mat(p + t + ".weight", n_ff, n_embd)
            mat(p + "ffn_down.weight", n_embd, n_ff)
            vec(p + "layer_output_norm.weight", n_embd, 1.0, 0.1)
            vec(p + "layer_output_norm.bias", n_embd)
            continue
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            mat(p + t + ".weight", n_embd, n_embd)
            vec(p + t + ".bias", n_embd)
        vec(p + "attn_output_norm.weight", n_embd, 1.0, 0.1)
        vec(p + "attn_output_norm.bias", n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        vec(p + "ffn_up.bias", n_ff)
        mat(p + "ffn_down.weight", n_embd, n_ff)
        vec(p + "ffn_down.bias", n_embd)
        vec(p + "layer_output_norm.weight", n_embd, 1.0, 0.1)
        vec(p + "layer_output_norm.bias", n_embd)
    if rank:
        head(norm=False)
    finish()


def embed_reference(path: Path, prefix: str = "") -> tuple[dict, dict]:
    import llama_cpp
    ref = {"model": path.name, "llama_cpp_python": llama_cpp.__version__, "texts": TEXTS, "tokenize": []}
    arrays = {}
    vocab = llama_cpp.Llama(str(path), n_ctx=128, verbose=False, vocab_only=True)
    for t in TEXTS:
        ref["tokenize"].append({"text": t, "ids": vocab.tokenize(t.encode(), add_bos=True, special=False),
                                "ids_special": vocab.tokenize(t.encode(), add_bos=True, special=True),
                                "ids_bare": vocab.tokenize(t.encode(), add_bos=False, special=False)})
    for name, kind in POOLING.items():
        if name == "rank":
            continue
        llm = llama_cpp.Llama(str(path), n_ctx=128, n_batch=128, n_ubatch=128, embedding=True, pooling_type=kind,
                              n_threads=2, verbose=False)
        for i, t in enumerate(TEXTS):
            out = np.asarray(llm.embed(t, normalize=False), np.float32)
            arrays[f"{prefix}{name}_{i}"] = out
        del llm
    return ref, arrays


def rank_reference(path: Path) -> tuple[dict, dict]:
    import llama_cpp
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_batch=128, n_ubatch=128, embedding=True,
                          pooling_type=POOLING["rank"], n_threads=2, verbose=False)
    tok = lambda s: llm.tokenize(s.encode(), add_bos=False, special=False)      # noqa: E731
    bos, sep = llm.token_bos(), 3
    ref = {"model": path.name, "llama_cpp_python": llama_cpp.__version__, "pairs": []}
    for query, docs in PAIRS:
        row = {"query": query, "documents": docs, "ids": [], "scores": []}
        for d in docs:
            ids = [bos] + tok(query) + [sep] + tok(d)             # format_prompt_rerank: add_bos, add_sep
            key = f"\x00{len(row['ids'])}:{query}:{d}"
            plain = llm.tokenize
            llm.tokenize = lambda text, *a, _ids=ids, **k: list(_ids)      # embed() tokenizes its text
            try:
                row["scores"].append(float(llm.embed(key, normalize=False)[0]))
            finally:
                llm.tokenize = plain
            row["ids"].append(ids)
        ref["pairs"].append(row)
    return ref, {}


def decoder_reference() -> dict:
    """A chat model embedding (tiny-qwen3, llama.cpp's result_norm pooled): mean and last (Qwen3-Embedding's)."""
    import llama_cpp
    arrays = {}
    for name in ("mean", "last"):
        llm = llama_cpp.Llama(str(TINY / "tiny-qwen3.gguf"), n_ctx=256, n_batch=256, n_ubatch=256, embedding=True,
                              pooling_type=POOLING[name], n_threads=2, verbose=False)
        for i, t in enumerate(TEXTS[:4]):
            arrays[f"qwen3_{name}_{i}"] = np.asarray(llm.embed(t, normalize=False), np.float32)
            arrays[f"qwen3_ids_{i}"] = np.asarray(llm.tokenize(t.encode()), np.int64)
        del llm
    return arrays


def main() -> None:
    emb, rr = TINY / "tiny-bert.gguf", TINY / "tiny-bert-rerank.gguf"
    write(emb, rank=False, seed=11)
    write(rr, rank=True, seed=12)
    ref, arrays = embed_reference(emb)
    arrays |= decoder_reference()
    nomic = TINY / "tiny-nomic-bert.gguf"
    write(nomic, rank=False, seed=13, arch="nomic-bert")
    arrays |= embed_reference(nomic, "nomic_")[1]
    jina = TINY / "tiny-jina-bert-v2.gguf"
    write(jina, rank=False, seed=14, arch="jina-bert-v2")
    arrays |= embed_reference(jina, "jina_")[1]
    modern = TINY / "tiny-modern-bert.gguf"
    write(modern, rank=False, seed=15, arch="modern-bert")
    arrays |= embed_reference(modern, "modern_")[1]
    modern_rr = TINY / "tiny-modern-bert-rerank.gguf"
    write(modern_rr, rank=True, seed=16, arch="modern-bert")
    (TINY / "tiny-modern-bert-rerank.json").write_text(json.dumps(rank_reference(modern_rr)[0], indent=1))
    (TINY / "tiny-bert.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1))
    np.savez_compressed(TINY / "tiny-bert.npz", **arrays)
    ref, _ = rank_reference(rr)
    (TINY / "tiny-bert-rerank.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1))
    print("wrote", emb, rr, file=sys.stderr)


if __name__ == "__main__":
    main()
