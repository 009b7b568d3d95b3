"""Engine speed, as JSON: prefill tok/s (512-token prompt), decode tok/s (128 tokens), peak
RSS, median of N runs. If `llama_cpp` is importable the same workload runs through it in this
run and the ratios are printed; otherwise the reference figures of tests/data/README.md are
printed and marked as measured elsewhere.

    python bench/engine.py [--model default|PATH] [--runs 5] [--threads 2] [--kernels compiled|numpy]
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


def kiln_runs(path: Path, runs: int, n_prompt: int, n_decode: int) -> dict:
    from kiln.native import kernels
    from kiln.native.model import load_model
    rss0 = psutil.Process().memory_info().rss
    t = time.perf_counter()
    model = load_model(path)
    load_s = time.perf_counter() - t
    rss_loaded = psutil.Process().memory_info().rss
    ids = prompt_ids(model.tokenizer, n_prompt)
    pre, dec = [], []
    for _ in range(runs):
        cache = model.new_cache(n_prompt + n_decode + 1)
        t = time.perf_counter()
        logits = model.forward(ids, cache)
        pre.append(n_prompt / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(n_decode):
            logits = model.forward([int(logits.argmax())], cache)
        dec.append(n_decode / (time.perf_counter() - t))
    return {"prefill_tok_s": round(statistics.median(pre), 1), "decode_tok_s": round(statistics.median(dec), 1),
            "prefill_runs": [round(x, 1) for x in pre], "decode_runs": [round(x, 1) for x in dec],
            "load_s": round(load_s, 2), "model_rss_bytes": rss_loaded - rss0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "file_bytes": path.stat().st_size, "kernels": kernels.kernel_info()}


def llama_cpp_runs(path: Path, runs: int, n_prompt: int, n_decode: int, threads: int) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False, logits_all=False)
    ids = llm.tokenize((ROOT / "tests" / "data" / "perplexity" / "GPL-3.txt").read_bytes(), add_bos=False)[:n_prompt]
    pre, dec = [], []
    for _ in range(runs):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        pre.append(n_prompt / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(n_decode):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        dec.append(n_decode / (time.perf_counter() - t))
    return {"prefill_tok_s": round(statistics.median(pre), 1), "decode_tok_s": round(statistics.median(dec), 1),
            "version": llama_cpp.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--kernels", choices=["compiled", "numpy"], default="compiled")
    args = ap.parse_args()
    from kiln.native import kernels
    from kiln.native.library import resolve_model
    kernels.use_compiled(args.kernels == "compiled")
    kernels.set_threads(args.threads)
    path = resolve_model(args.model, pull=args.model == "default")
    out = {"benchmark": "engine", "model": path.name, "threads": args.threads, "runs": args.runs,
           "prompt_tokens": args.prompt, "decode_tokens": args.decode,
           "kiln": kiln_runs(path, args.runs, args.prompt, args.decode)}
    ref = llama_cpp_runs(path, args.runs, args.prompt, args.decode, args.threads)
    if ref is not None:
        out["llama_cpp"] = {**ref, "source": "measured in this run"}
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
