"""How large an expert cache a streamed MoE should get — measured on this machine, not guessed.

The best size is a peak, not "as large as fits": past the point where the hot experts are
resident, more cache buys little, and the memory it takes is memory the page cache (the
non-expert weights, other programs) no longer has. `tune` decodes a short stretch of real text
teacher-forced (the routing of real text) with caches of several sizes — each a fraction of the
expert bytes, none larger than what the machine has available beside the rest of the model —
and suggests the smallest whose speed is within 5 % of the fastest.

Results are kept in <KILN_HOME>/expert-cache-tuning.json, keyed by the model file (path, size,
mtime), so `kiln up --stream --expert-cache auto` and `expert_cache = "auto"` use them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)
WITHIN = 0.95               # the smallest size reaching this share of the best speed wins
RUNTIME_BYTES = 512 << 20   # Python, numpy, KV cache and buffers beside the weights
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made "
        "books cheaper to produce. Within fifty years, presses were working in more than two hundred "
        "cities, and the number of books in Europe grew from thousands to millions. def merge(a, b):\n"
        "    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
        "    return out + a + b\n")


def _identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}"


def load_tuned(home: Path, path: Path) -> dict | None:
    """The tuning measured earlier for this exact file, or None."""
    try:
        return json.loads((Path(home) / "expert-cache-tuning.json").read_text()).get(_identity(Path(path)))
    except (OSError, ValueError):
        return None


def save_tuned(home: Path, path: Path, result: dict) -> None:
    f = Path(home) / "expert-cache-tuning.json"
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        data = {}
    data[_identity(Path(path))] = result
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, f)


def tune(path: Path, *, tokens: int = 32, warmup: int = 8, available: int | None = None,
         fractions=FRACTIONS, progress=None) -> dict:
    """Measure decode tok/s with expert caches of `fractions` of the expert bytes (those that
    fit in `available` bytes beside the non-expert weights) and suggest one. `progress(msg)`
    hears about each run."""
    import psutil

    from ..experts.cache import ExpertCache, budget_for
    from ..experts.store import ExpertStore, expert_map
    from ..model import load_model

    path = Path(path)
    model = load_model(path)
    c = model.config
    if not c.is_moe:
        raise ValueError(f"{path.name} is not a mixture-of-experts model: there is no expert cache to size")
    experts = {s.name for s in expert_map(model.gguf).values()}
    non_expert = sum(t.n_bytes for n, t in model.gguf.tensors.items() if n not in experts)
    store = ExpertStore(path, parts=model.gguf.parts)
    probe = ExpertCache(model.gguf, store, 1)
    slot_bytes, total_slots = probe.slot_bytes, c.n_layer * c.n_expert
    probe.close()
    if available is None:
        available = psutil.virtual_memory().available
    room = available - non_expert - RUNTIME_BYTES
    ids = model.tokenizer.encode(TEXT)
    ids = (ids * (1 + (warmup + tokens) // max(1, len(ids))))[:warmup + tokens + 1]
    runs = []
    for frac in fractions:
        slots = max(c.n_expert_used, int(total_slots * frac))
        # the budget that gives this many slots (a bare slots × slot_bytes gave one slot fewer: a
        # cache of the smallest size was then refused at the worker's boot as too small)
        cache_bytes = budget_for(slots, slot_bytes)
        if cache_bytes > room:
            runs.append({"fraction": frac, "cache_bytes": cache_bytes, "skipped": "does not fit in available RAM"})
            continue
        cache = ExpertCache(model.gguf, store, slots)
        model.expert_provider = cache
        kv = model.new_cache(len(ids) + 1)
        model.forward(ids[:1], kv)
        for t in ids[1:1 + warmup]:
            model.forward([t], kv)
        h0, m0 = cache.hits, cache.misses
        t0 = time.perf_counter()
        for t in ids[1 + warmup:]:
            model.forward([t], kv)
        tok_s = tokens / (time.perf_counter() - t0)
        hits, misses = cache.hits - h0, cache.misses - m0
        runs.append({"fraction": frac, "cache_bytes": cache_bytes, "tok_s": round(tok_s, 2),
                     "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None})
        model.expert_provider = None
        cache.close()
        del cache
        if progress:
            progress(f"expert cache {frac:.0%} ({cache_bytes / 2**30:.2f} GiB): {tok_s:.2f} tok/s, "
                     f"hit rate {runs[-1]['hit_rate']}")
    store.close()
    measured = [r for r in runs if "tok_s" in r]
    if not measured:
        raise ValueError(f"no expert cache of {', '.join(f'{f:.0%}' for f in fractions)} of "
                         f"{total_slots * slot_bytes / 2**30:.2f} GiB fits in the {available / 2**30:.2f} GiB available")
    best = max(r["tok_s"] for r in measured)
    pick = min((r for r in measured if r["tok_s"] >= WITHIN * best), key=lambda r: r["cache_bytes"])
    return {"model": path.name, "suggested_bytes": int(pick["cache_bytes"]), "suggested_fraction": pick["fraction"],
            "best_tok_s": best, "runs": runs, "tokens": tokens, "warmup": warmup,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "expert_bytes": total_slots * slot_bytes,
            "rule": f"the smallest cache within {WITHIN:.0%} of the fastest"}
