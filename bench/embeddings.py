"""Embedding throughput: 32 inputs embedded in one forward against one at a time, and against
llama.cpp (llama-cpp-python 0.3.36, `embed`) on the same inputs in the same run.

The model is a random-weight BERT of bge-small's shape (12 layers, 384 wide, 12 heads, FFN 1536,
512 positions, a 30,522-token WordPiece vocabulary), written in F16 and quantized to Q8_0 with
llama.cpp's own quantizer; kept in `.cache/bench-models/`.

    python bench/embeddings.py                    # Q8_0 and F16, 32 inputs of ~48 tokens
    python bench/embeddings.py --inputs 64 --words 100 --runs 5

Prints one JSON line per model: inputs/s of each way (median of --runs), the ratios (Kiln's
batched over one at a time; Kiln's batched over llama.cpp's), and the closeness of the vectors:
Kiln's to llama.cpp's, and llama.cpp's batched to its own one at a time (its noise floor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tools"))
OUT = ROOT / ".cache" / "bench-models"
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
         "an they you were her she there been one all we their has would when if so no what up out more can who "
         "said will about some time into only them other then than its over also new these two may first "
         "kiln clay pottery oven fire search query document rank model learning embedding vector").split()


def vocabulary(n: int) -> tuple[list[str], list[int]]:
    """BERT's specials, every letter and digit as a word start and a continuation, the words above,
    then filler pieces up to n tokens (bge-small's 30,522)."""
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-":
        tokens += ["▁" + c, c]
    tokens += ["▁" + w for w in WORDS if "▁" + w not in tokens]
    tokens += [f"▁x{i}" for i in range(n - len(tokens))]
    return tokens, [3] * 5 + [1] * (len(tokens) - 5)


def build(quant: str) -> Path:
    from gguf import GGMLQuantizationType as Q
    from make_tiny_bert import write_bert
    OUT.mkdir(parents=True, exist_ok=True)
    f16 = OUT / "bge-small-shape.F16.gguf"
    if not f16.exists():
        tokens, types = vocabulary(30522)
        write_bert(f16, tokens, types, rank=False, seed=0, qt=Q.F16, n_embd=384, n_head=12, n_ff=1536,
                   n_layer=12, n_ctx=512)
    if quant == "F16":
        return f16
    out = OUT / f"bge-small-shape.{quant}.gguf"
    if not out.exists():
        import llama_cpp
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"Q8_0": 7, "Q4_K_M": 15}[quant]
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize {f16} to {quant}")
    return out


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", nargs="+", default=["Q8_0", "F16"])
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--words", type=int, default=40, help="words per input (~1.2 tokens each)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import llama_cpp

    from kiln.native import kernels
    from kiln.native.encoder import load_encoder
    kernels.set_threads(a.threads)
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, a.words)) for _ in range(a.inputs)]
    for quant in a.quant:
        path = build(quant)
        enc = load_encoder(path, threads=a.threads)
        ids = [enc.tokenizer.encode(t, special=False) for t in texts]
        llm = llama_cpp.Llama(str(path), n_ctx=8192, n_batch=8192, n_ubatch=8192, embedding=True, n_threads=a.threads,
                              n_seq_max=a.inputs, verbose=False)
        enc.pooled(ids[:2])                                             # warm: page the weights in
        llm.embed(texts[:2])
        batched = timed(lambda: enc.pooled(ids), a.runs)
        alone = timed(lambda: [enc.pooled([x]) for x in ids], a.runs)
        ref = timed(lambda: llm.embed(texts), a.runs)
        ref_alone = timed(lambda: [llm.embed(t) for t in texts], a.runs)
        cosine = lambda a, b: float(np.min(np.sum(a * b, 1) / np.linalg.norm(a, axis=1)   # noqa: E731
                                           / np.linalg.norm(b, axis=1)))
        got, want = np.array(enc.pooled(ids)), np.array(llm.embed(texts))
        alone_ref = np.array([llm.embed(t) for t in texts])
        n = a.inputs
        print(json.dumps({"model": path.name, "inputs": n, "tokens": sum(map(len, ids)), "threads": a.threads,
                          "kiln_batched_inputs_per_s": round(n / batched, 1),
                          "kiln_one_at_a_time_inputs_per_s": round(n / alone, 1),
                          "llama_cpp_batched_inputs_per_s": round(n / ref, 1),
                          "llama_cpp_one_at_a_time_inputs_per_s": round(n / ref_alone, 1),
                          "batched_over_one_at_a_time": round(alone / batched, 2),
                          "kiln_over_llama_cpp_batched": round(ref / batched, 2),
                          # against llama.cpp one input at a time (its graph for one input: Kiln's)
                          "min_cosine_vs_llama_cpp": round(cosine(got, alone_ref), 7),
                          "max_abs_diff_vs_llama_cpp": float(np.abs(got - alone_ref).max()),
                          # llama.cpp's own batched against its one at a time: its noise floor
                          "llama_cpp_self_min_cosine": round(cosine(want, alone_ref), 7)}), flush=True)
        del llm


if __name__ == "__main__":
    main()
