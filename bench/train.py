"""LoRA training speed, as JSON: tokens/s of one forward + backward + AdamW step on a
sequence of `--seq` tokens (loss on its second half), median of N steps, peak RSS, and where
a step's time goes (cProfile, by function). Default: the default model, r 16 on all seven
targets, 256 tokens.

    python bench/train.py [--model default|PATH] [--seq 256] [--steps 5] [--rank 16]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()

    from kiln.native.models.library import resolve_model
    from kiln.native.lora import LoraConfig, init_adapter
    from kiln.native.training.lora_grad import FrozenBase, loss_and_grads
    from kiln.native.model import load_model
    from kiln.native.training.optim import AdamW

    path = resolve_model(args.model, pull=args.model == "default")
    t = time.perf_counter()
    model = load_model(path)
    base = FrozenBase(model)                       # dense float32 copies of the frozen weights
    setup_s = time.perf_counter() - t
    ad = init_adapter(model, LoraConfig(rank=args.rank), np.random.default_rng(0))
    names = list(ad.tensors)
    params = [x for n in names for x in ad.tensors[n]]
    grads = [np.zeros_like(p) for p in params]
    gmap = {n: (grads[2 * i], grads[2 * i + 1]) for i, n in enumerate(names)}
    opt = AdamW(params, 2e-4)
    text = (ROOT / "tests" / "data" / "perplexity" / "GPL-3.txt").read_text()
    tokens = model.tokenizer.encode(text, add_bos=False)[:args.seq]
    targets = list(range(len(tokens) // 2, len(tokens)))

    def step():
        for g in grads:
            g.fill(0)
        loss, n = loss_and_grads(base, ad.tensors, ad.scale, tokens, targets, gmap, 1.0 / len(targets))
        opt.step(grads)
        return loss / n

    step()                                          # warm up (page in the weights)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    top = sorted(((v[2], f"{Path(k[0]).name}:{k[2]}") for k, v in st.stats.items()), reverse=True)[:8]
    med = statistics.median(times)
    print(json.dumps({
        "model": path.name, "rank": args.rank, "targets": 7, "trainable_params": int(sum(p.size for p in params)),
        "seq_len": len(tokens), "steps": args.steps,
        "step_s_median": round(med, 3), "tokens_per_s": round(len(tokens) / med, 1),
        "step_s_all": [round(x, 3) for x in times],
        "setup_s": round(setup_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "profile_self_s": {name: round(s, 3) for s, name in top}, "profile_total_s": round(total, 3),
    }, indent=1))


if __name__ == "__main__":
    main()
