"""Long contexts, as JSON: for each KV cache type (f16, q8_0, q4_0) the bytes per 1,000 positions
and decode tok/s with 2k, 8k and 16k positions in the cache — each type's ratio to fp16's in the
same run, the runs interleaved so that all see the same machine.

    python bench/context.py [--model default|PATH] [--contexts 2048,8192,16384] [--steps 16] [--runs 3]

The cache is filled with synthetic keys and values (random, stored as each type stores them):
a decode step's cost depends on how many positions it attends to, not on what they hold, and
prefilling 16k tokens for each type and run would take most of an hour on 2 cores. Layers that
keep a recurrent state instead of keys cannot be filled so: models with them are refused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

TYPES = ("f16", "q8_0", "q4_0")


def fill(model, cache, n: int, seed: int = 0) -> None:
    """n synthetic positions in every layer of `cache` (keys and values ~ N(0, 1), stored as
    the cache's types store them: the kernels read real blocks)."""
    c = model.config
    rng = np.random.default_rng(seed)
    tokens = [1] * n
    cache.begin(tokens)
    for i in range(c.n_layer):
        k = rng.standard_normal((n, c.n_head_kv, c.head_dim), dtype=np.float32)
        v = rng.standard_normal((n, c.n_head_kv, c.head_dim), dtype=np.float32)
        if i in cache._windows:
            cache.store_window(i, k, v)
        else:
            cache.store(i, k, v)
    cache.commit(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--types", default=",".join(TYPES))
    args = ap.parse_args()
    from kiln.native import kernels
    from kiln.native.model import load_model
    from kiln.native.models.library import resolve_model
    path = Path(resolve_model(args.model, pull=args.model == "default"))
    model = load_model(path)
    if model.family.recurrent_state(model.config):
        raise SystemExit(f"{path.name}: recurrent layers keep a state that synthetic positions cannot fill")
    types = args.types.split(",")
    contexts = [int(x) for x in args.contexts.split(",")]
    out = {"benchmark": "context", "model": path.name, "kernels": kernels.kernel_info(), "steps": args.steps,
           "runs": args.runs, "types": {}}
    for t in types:
        cache = model.new_cache(1024, dtype=t)
        cache.begin([0] * 1024)
        out["types"][t] = {"bytes_per_1k_positions": cache.nbytes}
    for n in contexts:
        caches = {}
        for t in types:
            caches[t] = model.new_cache(n + args.steps * (args.runs + 1) + 1, dtype=t)
            fill(model, caches[t], n)
            model.forward([1], caches[t])                        # warm: page in, allocate
        times = {t: [] for t in types}
        for _ in range(args.runs):                               # interleaved: the same machine for all
            for t in types:
                tic = time.perf_counter()
                for _ in range(args.steps):
                    model.forward([1], caches[t])
                times[t].append(args.steps / (time.perf_counter() - tic))
        for t in types:
            out["types"][t][f"decode_tok_s_at_{n}"] = round(statistics.median(times[t]), 2)
            out["types"][t][f"decode_runs_at_{n}"] = [round(x, 2) for x in times[t]]
        del caches
    base = out["types"].get("f16")
    if base:
        for t, r in out["types"].items():
            r["bytes_vs_f16"] = round(r["bytes_per_1k_positions"] / base["bytes_per_1k_positions"], 4)
            for n in contexts:
                r[f"decode_vs_f16_at_{n}"] = round(r[f"decode_tok_s_at_{n}"] / base[f"decode_tok_s_at_{n}"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
