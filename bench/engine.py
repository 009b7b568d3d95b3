"""Engine speed, as JSON: prefill tok/s (512-token prompt), decode tok/s (128 tokens), peak
RSS, median of N runs. If `llama_cpp` is importable the same workload runs through it in this
run, interleaved with ours run by run, and the ratios are medians of the run pairs; otherwise the reference figures of tests/data/README.md are
printed and marked as measured elsewhere.

    python bench/engine.py [--model default|PATH] [--runs 5] [--threads 2] [--kernels compiled|numpy]
    python bench/engine.py --suite sizes [--runs 3] [--shape S ...] [--quant Q ...] [--table FILE]

`--suite sizes` runs every model bench/bench_models.py made (shapes of real models, quantized by
llama.cpp) against llama.cpp, each engine in processes of its own: bench/engine_sizes.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = {"SmolLM2-135M-Instruct.Q4_1": {"prefill_tok_s": 153, "decode_tok_s": 50},
             "SmolLM2-135M-Instruct-MoE-E8K2": {"prefill_tok_s": 241, "decode_tok_s": 67}}


def prompt_ids(tok, n: int) -> list[int]:
    text = (ROOT / "tests" / "data" / "perplexity" / "GPL-3.txt").read_text()
    return tok.encode(text, add_bos=False)[:n]


def kiln_setup(path: Path, n_prompt: int, n_decode: int):
    """Load the model; return (one run -> (prefill tok/s, decode tok/s), facts)."""
    from kiln.native import kernels
    from kiln.native.model import load_model
    rss0 = psutil.Process().memory_info().rss
    t = time.perf_counter()
    model = load_model(path)
    load_s = time.perf_counter() - t
    facts = {"load_s": round(load_s, 2), "model_rss_bytes": psutil.Process().memory_info().rss - rss0,
             "file_bytes": path.stat().st_size, "kernels": kernels.kernel_info()}
    ids = prompt_ids(model.tokenizer, n_prompt)

    def once() -> tuple[float, float]:
        cache = model.new_cache(n_prompt + n_decode + 1)
        t = time.perf_counter()
        logits = model.forward(ids, cache)
        pre = n_prompt / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(n_decode):
            logits = model.forward([int(logits.argmax())], cache)
        return pre, n_decode / (time.perf_counter() - t)
    return once, facts


def llama_cpp_setup(path: Path, n_prompt: int, n_decode: int, threads: int):
    try:
        import llama_cpp
    except ImportError:
        return None, None
    llm = llama_cpp.Llama(str(path), n_ctx=max(2048, n_prompt + n_decode + 8), n_threads=threads, n_batch=512, verbose=False, logits_all=False)
    ids = llm.tokenize((ROOT / "tests" / "data" / "perplexity" / "GPL-3.txt").read_bytes(), add_bos=False)[:n_prompt]

    def once() -> tuple[float, float]:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        pre = n_prompt / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(n_decode):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        return pre, n_decode / (time.perf_counter() - t)
    return once, {"version": llama_cpp.__version__}


def _summary(runs: list[tuple[float, float]]) -> dict:
    pre, dec = [r[0] for r in runs], [r[1] for r in runs]
    return {"prefill_tok_s": round(statistics.median(pre), 1), "decode_tok_s": round(statistics.median(dec), 1),
            "prefill_runs": [round(x, 1) for x in pre], "decode_runs": [round(x, 1) for x in dec]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--kernels", choices=["compiled", "numpy"], default="compiled")
    ap.add_argument("--suite", choices=["sizes"], help="sizes: the bench_models.py models against llama.cpp")
    ap.add_argument("--shape", nargs="*", help="--suite sizes: only these shapes")
    ap.add_argument("--quant", nargs="*", help="--suite sizes: only these quants")
    ap.add_argument("--prompts", default="512,2048", help="--suite sizes: prompt lengths, comma-separated")
    ap.add_argument("--table", type=Path, help="--suite sizes: also write the markdown table here")
    args = ap.parse_args()
    if args.suite == "sizes":
        import engine_sizes
        from bench_models import OUT
        decode = args.decode if args.decode != 128 else 32
        engine_sizes.suite(OUT, args.runs if args.runs != 5 else 3, args.threads,
                           [int(x) for x in args.prompts.split(",")], decode, args.shape, args.quant, args.table)
        return
    from kiln.native import kernels
    from kiln.native.models.library import resolve_model
    kernels.use_compiled(args.kernels == "compiled")
    kernels.set_threads(args.threads)
    path = resolve_model(args.model, pull=args.model == "default")
    out = {"benchmark": "engine", "model": path.name, "threads": args.threads, "runs": args.runs,
           "prompt_tokens": args.prompt, "decode_tokens": args.decode}
    kiln_once, facts = kiln_setup(path, args.prompt, args.decode)
    llama_once, llama_facts = llama_cpp_setup(path, args.prompt, args.decode, args.threads)
    kiln_once()                                    # warm up both (page in the weights)
    if llama_once:
        llama_once()
    k_runs, l_runs = [], []
    for _ in range(args.runs):                     # interleaved, so that both see the same machine
        k_runs.append(kiln_once())
        if llama_once:
            l_runs.append(llama_once())
    out["kiln"] = {**_summary(k_runs), **facts,
                   "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if llama_once:
        out["llama_cpp"] = {**_summary(l_runs), **llama_facts, "source": "measured in this run, interleaved"}
        out["ratio"] = {"prefill": round(statistics.median(k[0] / x[0] for k, x in zip(k_runs, l_runs)), 2),
                        "decode": round(statistics.median(k[1] / x[1] for k, x in zip(k_runs, l_runs)), 2),
                        "how": "median over runs of kiln/llama.cpp in the same run pair"}
    else:
        out["llama_cpp"] = {**REFERENCE.get(path.stem, {}),
                            "source": "tests/data/README.md (llama-cpp-python 0.3.36, 2 threads, another run on "
                                      "this kind of machine) — llama_cpp is not installed here"}
        lc = out["llama_cpp"]
        if lc.get("decode_tok_s"):
            out["ratio"] = {"prefill": round(out["kiln"]["prefill_tok_s"] / lc["prefill_tok_s"], 2),
                            "decode": round(out["kiln"]["decode_tok_s"] / lc["decode_tok_s"], 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
