"""MoE expert streaming against in-RAM decode and the OS page cache, in one run: JSON + a PNG.

Builds (once, into .cache/bench/) a random-weight Mixtral-style llama MoE — by default 16
layers × 64 experts (4 used), n_embd 1024, expert FFN 1536, Q4_0: 2.7 GB of experts — then:

- **raw disk**: O_DIRECT reads of that file — 8 MiB sequential, and reads of one expert
  projection's size at random offsets with 1, 4 and 16 in flight; `raw_gb_s` is the best; the
  random reads into destinations spread over 1 GiB, as the cache's slots are (`raw_spread_gb_s`;
  the others reuse a few buffers, which this VM fills faster), and beside an in-RAM decode in
  another process (`raw_beside_decode_gb_s`: what the disk gives while both vCPUs compute);
- **in RAM**: the file memory-mapped and paged in; a warm-up, then the measured tokens — run
  again right before every other configuration, whose `vs_ram` is against that run (the
  machine's speed drifts over minutes on shared vCPUs, and with the pages the page cache gave
  the file: `file_pmd_mapped_bytes` says how much of it was mapped in 2 MiB pages);
- **streamed** (O_DIRECT into the expert cache) for each policy × budget (% of the expert
  bytes): tok/s after the warm-up, hit rate, bytes read per token, read GB/s while reads were in
  flight (as a fraction of raw, of raw into spread destinations — both taken right before and
  after the run — and of raw beside decode), the mean reads in flight then, decode
  stall per token, read-ahead recall and waste;
  also, per budget (LRFU), streamed against in-RAM decode in one process, blocks of 16 tokens
  alternating on the same sequence (`interleaved`: free of the machine's drift; at 100 % the
  cost of the hit path alone);
- **page cache**: the same model with its experts read through mmap — the OS's own caching —
  under the same memory limit as the streamed run of that budget;
- **traces**: routing recorded from real text through the tiny MoE references and the MoE-fied
  SmolLM2 variants (skewed, unlike the synthetic model's), replayed offline through every policy
  and budget (native/expert_policy.py — the classes the cache runs) against Belady's optimum.

Each measured configuration runs in its own process, in the environment `kiln up` gives a worker
(libgomp's spin as supervisor/processes.py sets it); `summary` has the median ratio per policy and
budget over the `--repeat` pairs; `acceptance` puts the expert-streaming issue's bars beside every
reading of this run that speaks to them. The memory limit is a cgroup (v1
`memory.limit_in_bytes` or v2 `memory.max`, root only): non-expert bytes + the budget + 512 MiB
for the runtime, for the streamed and the page-cache run alike; the file is evicted from the
page cache (posix_fadvise DONTNEED) before each. Without cgroups the page-cache baseline is
skipped and the JSON says why.

    python bench/moe_stream.py [--warmup 32] [--tokens 128] [--budgets 10,25,50,100]
                               [--policies lru,lfu,lrfu] [--repeat 1] [--plot F.png]
                               [--layers 16 --experts 64 --used 4 --embd 1024 --ff 1536]

The plot needs matplotlib (`pip install matplotlib`); without it the JSON is still printed.
Decode steps feed a fixed pseudo-random token sequence (see `decode`). Never run it beside a
test suite: every figure is a ratio against in-RAM decode measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
from moe_model import ROOT, build_model
from moe_stream_disk import evict, file_pmd_mapped, raw_direct_reads, worker_env
from moe_stream_report import acceptance, plot, replay_traces

def decode(model, prompt: list[int], n: int, warmup: int) -> tuple[float, dict | None, dict | None]:
    """Prefill, `warmup` decode steps, then `n` measured ones: (tok/s, cache figures before and
    after the measured steps). The tokens are a fixed pseudo-random sequence, not the model's
    argmax: a random-weight model's greedy output repeats one token, and the same token routes to
    the same experts every step, which would measure nothing but cache hits."""
    cache = model.new_cache(len(prompt) + warmup + n + 1)
    model.forward(prompt, cache)
    steps = np.random.default_rng(7).integers(0, model.config.n_vocab, warmup + n).tolist()
    for tok in steps[:warmup]:
        model.forward([tok], cache)
    provider = model.expert_provider
    before = snapshot(provider)
    t = time.perf_counter()
    for tok in steps[warmup:]:
        model.forward([tok], cache)
    return n / (time.perf_counter() - t), before, snapshot(provider)


def snapshot(c) -> dict | None:
    if c is None:
        return None
    return {"hits": c.hits, "misses": c.misses, "bytes": c.bytes_read, "read_s": c.read_seconds,
            "wait_s": c.wait_seconds, "depth_s": c.read_depth_seconds, "tokens": c.tokens, "ra_reads": c.spec_reads, "ra_used": c.spec_used,
            "ra_wasted": c.spec_wasted_bytes, "recall_hits": c.recall_hits, "recall_total": c.recall_total}


def figures(before: dict, after: dict) -> dict:
    from kiln.native.experts.cache import mean_depth
    d = {k: after[k] - before[k] for k in after if k != "depth_s"}
    depth = [b - a for a, b in zip(before["depth_s"], after["depth_s"])]
    tokens = d["tokens"] or 1
    gb_s = d["bytes"] / d["read_s"] / 1e9 if d["read_s"] else None
    return {"hit_rate": round(d["hits"] / (d["hits"] + d["misses"]), 4) if d["hits"] + d["misses"] else None,
            "bytes_read_per_token": round(d["bytes"] / tokens),
            "read_gb_s": round(gb_s, 3) if gb_s else None,
            "read_queue_depth": mean_depth(depth),
            "stall_ms_per_token": round(1000 * d["wait_s"] / tokens, 2),
            "read_ahead": {"reads": d["ra_reads"], "used": d["ra_used"], "wasted_bytes": d["ra_wasted"],
                           "recall": round(d["recall_hits"] / d["recall_total"], 4) if d["recall_total"] else None}}


# -- one configuration, in its own process ----------------------------------------------------------

def interleaved_vs_ram(spec: dict) -> dict:
    """Streamed against in-RAM decode in one process: blocks of decode steps alternate between
    the streamed forward (through the expert cache) and the in-RAM one on the same sequence — so
    the machine's drift, which moves whole runs by 30 % on shared vCPUs, falls on both alike.
    At 100 % the cache holds every expert (the cost of the hit path alone); below, the cache of
    `budget_pct` is warmed by `warmup` streamed steps and keeps its state across the in-RAM
    blocks (it is not limited to a cgroup: its reads bypass the page cache, which holds the
    whole file for the in-RAM side; `weights`: "private" copies the model's weights into huge
    pages first, the in-RAM side's experts included). Returns the median of the block ratios."""
    from kiln.native.experts.cache import ExpertCache
    from kiln.native.experts.store import ExpertStore
    from kiln.native.model import load_model
    path = Path(spec["path"])
    pct = spec.get("budget_pct", 100)
    model = load_model(path, weights=spec.get("weights", "mapped"))     # private: the in-RAM side's too
    with open(path, "rb", buffering=0) as f:              # the in-RAM side reads the mapped file
        while f.read(64 << 20):
            pass
    c = model.config
    slots = max(1, c.n_layer * c.n_expert * pct // 100)
    cache = ExpertCache(model.gguf, ExpertStore(path, direct=True), slots, policy=spec.get("policy", "lrfu"))
    if pct >= 100:
        for layer in range(c.n_layer):
            cache.prefetch(layer, range(c.n_expert))
    block, rounds = 16, max(4, spec["tokens"] // 16)
    steps = np.random.default_rng(7).integers(0, c.n_vocab, spec["warmup"] + 2 * block * rounds).tolist()
    kv = model.new_cache(len(steps) + 32)
    model.expert_provider = cache
    model.forward(model.tokenizer.encode("The quick brown fox jumps over the lazy dog.")[:12], kv)
    for tok in steps[:spec["warmup"]]:
        model.forward([tok], kv)
    times: dict = {"stream": [], "ram": []}
    at, seen = spec["warmup"], (cache.hits, cache.misses)
    for r in range(rounds):
        for mode in ("stream", "ram") if r % 2 == 0 else ("ram", "stream"):
            model.expert_provider = cache if mode == "stream" else None
            t = time.perf_counter()
            for tok in steps[at:at + block]:
                model.forward([tok], kv)
            times[mode].append((time.perf_counter() - t) / block)
            at += block
    hits, misses = cache.hits - seen[0], cache.misses - seen[1]
    cache.close()
    ratios = [r / s for s, r in zip(times["stream"], times["ram"])]
    return {"mode": "interleaved", "budget_pct": pct, "policy": cache.policy.name, "blocks": rounds,
            "weights": spec.get("weights", "mapped"),
            "block_tokens": block,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
            "stream_tok_s": round(1 / statistics.median(times["stream"]), 2),
            "in_ram_tok_s": round(1 / statistics.median(times["ram"]), 2),
            "vs_ram": round(statistics.median(ratios), 3), "vs_ram_blocks": [round(x, 3) for x in ratios],
            "file_pmd_mapped_bytes": file_pmd_mapped()}


def run_one(spec: dict) -> dict:
    """spec: {path, mode: ram|stream|pagecache, budget_pct, policy, read_ahead, preload, warmup,
    tokens}; mode interleaved: interleaved_vs_ram."""
    if spec["mode"] == "interleaved":
        return interleaved_vs_ram(spec)
    from kiln.native.experts.cache import ExpertCache
    from kiln.native.experts.store import ExpertStore
    from kiln.native.model import load_model
    path = Path(spec["path"])
    model = load_model(path)
    prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)[:24]
    out = {k: spec[k] for k in ("mode", "budget_pct", "policy", "preload") if k in spec}
    if spec["mode"] == "stream":
        out["read_ahead_on"] = spec.get("read_ahead", True)
    if spec["mode"] == "ram":
        with open(path, "rb", buffering=0) as f:          # the whole file into the page cache
            while f.read(64 << 20):
                pass
    elif spec["mode"] == "stream":
        store = ExpertStore(path, direct=True)
        probe = ExpertCache(model.gguf, store, 1)
        slots = max(1, model.config.n_layer * model.config.n_expert * spec["budget_pct"] // 100)
        probe.close()
        cache = ExpertCache(model.gguf, store, slots, policy=spec["policy"])
        if not spec.get("read_ahead", True):
            cache.read_ahead_on = False
        if spec.get("preload"):
            for layer in range(model.config.n_layer):
                cache.prefetch(layer, range(model.config.n_expert))
        model.expert_provider = cache
        out.update(slots=slots, io_mode=store.io_mode, memory=cache.placement.kind, huge_pages=cache.placement.huge_pages)
    tok_s, before, after = decode(model, prompt, spec["tokens"], spec["warmup"])
    out["tok_s"] = round(tok_s, 2)
    if spec["mode"] == "ram":                             # the page cache's pages move this run's speed
        out["file_pmd_mapped_bytes"] = file_pmd_mapped()
    if spec["mode"] == "stream":                          # what the kernel gave, not what was asked
        out["huge_page_bytes"], out["cache_bytes"] = cache.stats()["huge_page_bytes"], len(cache.buffer)
    if before is not None:
        out.update(figures(before, after))
        model.expert_provider.close()
    out["peak_rss_bytes"] = _peak_rss()
    return out


def _peak_rss() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryLimit:
    """A cgroup with a memory limit for one child process (v1 or v2, root only)."""

    def __init__(self, limit: int):
        self.limit, self.path = limit, None
        for root, knob in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")):
            base = Path(root)
            if (base / "cgroup.procs").exists() and os.access(base, os.W_OK) and \
                    (knob == "memory.limit_in_bytes" or "memory" in (base / "cgroup.controllers").read_text()):
                self.path = base / f"kiln-bench-{os.getpid()}"
                self.knob = knob
                break

    def __enter__(self):
        if self.path is not None:
            try:
                self.path.mkdir(exist_ok=True)
                (self.path / self.knob).write_text(str(self.limit))
            except OSError:
                self.path = None
        return self

    def preexec(self):
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def __exit__(self, *exc):
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass


def paired(spec: dict, limit: int | None, ram: list, disk: dict) -> dict:
    """A streamed or page-cache run right after an in-RAM run: the machine's speed drifts over
    minutes (shared vCPUs), so each ratio is taken against the in-RAM run beside it — and a
    streamed run's read GB/s against raw reads right before and after it (`disk`: the full raw
    figures from the start of the run, for the read size and the raw beside decode)."""
    r0 = measure({**{k: spec[k] for k in ("path", "warmup", "tokens")}, "mode": "ram"})
    ram.append(r0)
    stream = spec["mode"] == "stream"
    raw = [raw_direct_reads(Path(spec["path"]), disk["read_bytes"], quick=True)] if stream else []
    r = measure(spec, limit)
    if "tok_s" in r and "tok_s" in r0:
        r["in_ram_tok_s"], r["vs_ram"] = r0["tok_s"], round(r["tok_s"] / r0["tok_s"], 3)
    if stream and r.get("read_gb_s"):
        # the disk drifts as the vCPUs do: the raw figures are the best of right before and right after
        raw.append(raw_direct_reads(Path(spec["path"]), disk["read_bytes"], quick=True))
        r["raw_gb_s"] = max(x["raw_gb_s"] for x in raw)
        r["raw_spread_gb_s"] = max(x["raw_spread_gb_s"] for x in raw)
        r["read_vs_raw"] = round(r["read_gb_s"] / r["raw_gb_s"], 3)
        r["read_vs_raw_spread"] = round(r["read_gb_s"] / r["raw_spread_gb_s"], 3)
        r["read_vs_raw_beside_decode"] = round(r["read_gb_s"] / disk["raw_beside_decode_gb_s"], 3)
    return r


def summary(streamed: list) -> list:
    """Median vs_ram (and tok/s) per policy, budget and read-ahead over the repeated pairs."""
    groups: dict = {}
    for r in streamed:
        if "vs_ram" in r:
            groups.setdefault((r["policy"], r["budget_pct"], r.get("read_ahead_on", True)), []).append(r)
    return [{"policy": p, "budget_pct": b, "read_ahead": ra, "runs": len(rs),
             "vs_ram_median": round(statistics.median(r["vs_ram"] for r in rs), 3),
             "vs_ram_range": [min(r["vs_ram"] for r in rs), max(r["vs_ram"] for r in rs)],
             "tok_s_median": round(statistics.median(r["tok_s"] for r in rs), 2),
             "read_vs_raw_median": _median_of(rs, "read_vs_raw"),
             "read_vs_raw_spread_median": _median_of(rs, "read_vs_raw_spread"),
             "read_vs_raw_beside_decode_median": _median_of(rs, "read_vs_raw_beside_decode")}
            for (p, b, ra), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0], not kv[0][2]))]


def _median_of(runs: list, key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def measure(spec: dict, limit: int | None = None) -> dict:
    import subprocess
    import sys
    evict(Path(spec["path"]))
    with MemoryLimit(limit) if limit else _nolimit() as lim:
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                              preexec_fn=lim.preexec if limit else None, timeout=3600, env=worker_env())
    if proc.returncode != 0:
        return {**spec, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    res = json.loads(proc.stdout)
    if limit:
        res["memory_limit_bytes"] = limit if lim.path is not None else None
    return res


class _nolimit:
    path = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


# -- routing traces ----------------------------------------------------------------------------------

def main() -> None:
    import sys
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(run_one(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=1536)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budgets", default="10,25,50,100")
    ap.add_argument("--policies", default="lru,lfu,lrfu")
    ap.add_argument("--repeat", type=int, default=1, help="in-RAM/streamed pairs per policy and budget")
    ap.add_argument("--skip-traces", action="store_true")
    ap.add_argument("--plot", default=str(ROOT / ".cache" / "bench" / "moe_stream.png"))
    args = ap.parse_args()

    from kiln.native.experts.cache import ExpertCache
    from kiln.native.experts.store import ExpertStore, expert_map
    from kiln.native.gguf_file import read_gguf

    name = f"synthetic-moe-v3-L{args.layers}-E{args.experts}K{args.used}-d{args.embd}-ff{args.ff}.gguf"
    t = time.perf_counter()
    path = build_model(ROOT / ".cache" / "bench" / name, args.layers, args.experts, args.used, args.embd, args.ff)
    build_s = time.perf_counter() - t
    g = read_gguf(path, skip_arrays=True)
    emap = expert_map(g)
    expert_names = {s.name for s in emap.values()}
    non_expert = sum(ti.n_bytes for n, ti in g.tensors.items() if n not in expert_names)
    store = ExpertStore(path)
    probe = ExpertCache(g, store, 1)
    slot_bytes = probe.slot_bytes
    probe.close()
    disk = raw_direct_reads(path, max(s.nbytes for s in emap.values()))
    out = {"benchmark": "moe_stream", "model": name, "file_bytes": path.stat().st_size, "build_s": round(build_s, 1),
           "layers": args.layers, "experts": args.experts, "used": args.used, "warmup_tokens": args.warmup,
           "decode_tokens": args.tokens, "expert_bytes": args.layers * args.experts * slot_bytes,
           "non_expert_bytes": non_expert, "disk": disk}
    base = {"path": str(path), "warmup": args.warmup, "tokens": args.tokens}
    ram: list = []
    out["in_ram"] = ram
    runtime = 512 << 20
    budgets = [int(b) for b in args.budgets.split(",")]
    streamed, page = [], []
    for pct in budgets:
        limit = non_expert + args.layers * args.experts * slot_bytes * pct // 100 + runtime
        for policy in args.policies.split(","):
            for _ in range(args.repeat):
                streamed.append(paired({**base, "mode": "stream", "budget_pct": pct, "policy": policy}, limit, ram, disk))
        if pct < 100:
            streamed.append(paired({**base, "mode": "stream", "budget_pct": pct, "policy": "lrfu", "read_ahead": False},
                                   limit, ram, disk))
            p = paired({**base, "mode": "pagecache", "budget_pct": pct}, limit, ram, disk)
            if p.get("memory_limit_bytes") is None:
                p["note"] = "no cgroup memory controller writable here: the page cache was not limited"
            page.append(p)
    interleaved = [measure({**base, "mode": "interleaved", "budget_pct": pct, "policy": "lrfu"}) for pct in budgets]
    out["in_ram_tok_s"] = statistics.median(r["tok_s"] for r in ram if "tok_s" in r)
    out["streamed"], out["page_cache"] = streamed, page
    out["summary"] = summary(streamed)
    out["interleaved"] = interleaved
    out["acceptance"] = acceptance(out)
    if not args.skip_traces:
        models = {"synthetic": path,
                  **{f"tiny-{a}": ROOT / "tests" / "data" / "tiny" / f"tiny-{a}.gguf"
                     for a in ("qwen2moe", "qwen3moe", "olmoe", "qwen35moe", "gpt-oss")},
                  **{f"smollm2-moe-e8k{k}": ROOT / ".cache" / "models" / f"SmolLM2-135M-Instruct-MoE-E8K{k}.gguf"
                     for k in (2,)}}
        out["trace_replay"] = replay_traces(models, budgets, args.policies.split(","))
    out["plot"] = plot(out, args.plot)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
