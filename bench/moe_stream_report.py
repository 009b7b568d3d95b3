"""The report half of bench/moe_stream.py: routing traces recorded from real text through small
MoE models and replayed offline through every policy and budget (against Belady's optimum), and
the PNG of the streamed runs against in-RAM decode and the page cache."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def record_trace(path: Path, texts: list[str], max_tokens: int = 600) -> list:
    """(layer, experts) for every token of `texts` fed one at a time (decode-like routing)."""
    from kiln.native.model import load_model

    class Recorder:
        def __init__(self, m):
            self.m, self.trace = m, []

        def prefetch(self, layer, experts, rows=0):
            self.trace.append((layer, sorted(int(e) for e in experts)))

        def weights(self, layer, e):
            return self.m.layers[layer].expert(int(e))
    m = load_model(path)
    rec = Recorder(m)
    m.expert_provider = rec
    n = 0
    for text in texts:
        ids = m.tokenizer.encode(text)[:max_tokens - n]
        cache = m.new_cache(len(ids) + 1)
        for t in ids:
            m.forward([t], cache)
        n += len(ids)
        if n >= max_tokens:
            break
    return rec.trace


def replay_traces(models: dict, budgets: list[int], policies: list[str]) -> dict:
    from kiln.native.experts.policy import belady, make_policy, replay
    from kiln.native.gguf_file import read_gguf
    texts = [p["text"] if isinstance(p, dict) else p
             for p in json.loads((ROOT / "tests" / "data" / "prompts_tiny.json").read_text())["prompts"]]
    out = {}
    for name, path in models.items():
        if not path.exists():
            continue
        g = read_gguf(path, skip_arrays=True)
        arch = g.architecture
        layers, experts = int(g.get(f"{arch}.block_count")), int(g.get(f"{arch}.expert_count"))
        trace = record_trace(path, texts)
        warm = len(trace) // 4
        rows = []
        for pct in budgets:
            slots = max(1, layers * experts * pct // 100)
            row = {"budget_pct": pct, "belady": round(belady(trace, slots, warm), 4)}
            for pol in policies:
                row[pol] = round(replay(trace, make_policy(pol), slots, warm), 4)
            rows.append(row)
        out[name] = {"layers": layers, "experts": experts, "routed_layers": len(trace), "hit_rates": rows}
    return out


def acceptance(out: dict) -> dict:
    """Issue 20's bars beside the figures of this run that speak to them — every reading of the
    same quantity, so that a reader sees which holds under which definition."""
    import statistics

    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 3) if xs else None
    il = {r["budget_pct"]: r.get("vs_ram") for r in out.get("interleaved", [])}
    runs = [r for r in out["streamed"] if "vs_ram" in r and r.get("read_ahead_on", True)]
    pairs = {pct: med(r["vs_ram"] for r in runs if r["budget_pct"] == pct) for pct in (25, 100)}
    page = next((p.get("vs_ram") for p in out["page_cache"] if p.get("budget_pct") == 25), None)
    read = [r for r in out["streamed"] if r.get("read_vs_raw")]
    return {
        "full_cache_vs_ram": {"bar": 0.95, "interleaved_in_one_process": il.get(100),
                              "separate_processes_median": pairs[100]},
        "quarter_cache_vs_ram": {"bar": 0.5, "interleaved_in_one_process": il.get(25),
                                 "separate_processes_median": pairs[25], "page_cache_same_limit": page},
        "read_vs_raw": {"bar": 0.8, "runs": len(read),
                        "vs_raw_reused_buffers_median": med(r["read_vs_raw"] for r in read),
                        "vs_raw_spread_destinations_median": med(r.get("read_vs_raw_spread") for r in read),
                        "vs_raw_beside_decode_median": med(r.get("read_vs_raw_beside_decode") for r in read)},
        "read_ahead_recall": {"goal": 0.8, "median": med((r.get("read_ahead") or {}).get("recall")
                                                         for r in runs if r["budget_pct"] < 100)},
    }


def plot(out: dict, dest: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    runs = [r for r in out["streamed"] if "tok_s" in r]
    for label, pick in [(p, lambda r, p=p: r["policy"] == p and r.get("read_ahead_on", True))
                        for p in sorted({r["policy"] for r in runs})] + \
            [("lrfu, no read-ahead", lambda r: r["policy"] == "lrfu" and r.get("read_ahead_on") is False)]:
        rs = sorted((r for r in runs if pick(r)), key=lambda r: r["budget_pct"])
        if not rs:
            continue
        x = [r["budget_pct"] for r in rs]
        axes[0].plot(x, [r["vs_ram"] for r in rs], "o-", label=f"O_DIRECT cache ({label})")
        axes[1].plot(x, [r["hit_rate"] for r in rs], "o-", label=label)
        io = [r for r in rs if r.get("read_vs_raw")]             # a cache that read nothing has no rate
        axes[2].plot([r["budget_pct"] for r in io], [r["read_vs_raw"] for r in io], "o-", label=label)
    pc = [p for p in out["page_cache"] if "tok_s" in p]
    if pc:
        axes[0].plot([p["budget_pct"] for p in pc], [p["vs_ram"] for p in pc], "s--", color="black",
                     label="page cache (mmap) at the same memory limit")
    il = sorted((r for r in out.get("interleaved", []) if "vs_ram" in r), key=lambda r: r["budget_pct"])
    if il:
        axes[0].plot([r["budget_pct"] for r in il], [r["vs_ram"] for r in il], "D:", color="tab:purple",
                     label="O_DIRECT cache (lrfu), interleaved in one process")
    axes[0].axhline(1.0, color="grey", ls="--", label=f"in RAM ({out['in_ram_tok_s']:.1f} tok/s)")
    axes[2].axhline(1.0, color="grey", ls="--", label="raw O_DIRECT right before/after the run (best)")
    beside = out["disk"]["raw_beside_decode_gb_s"] / out["disk"]["raw_gb_s"]
    axes[2].axhline(beside, color="grey", ls=":", label="raw beside an in-RAM decode ÷ raw (at the start)")
    spread = out["disk"]["raw_spread_gb_s"] / out["disk"]["raw_gb_s"]
    axes[2].axhline(spread, color="grey", ls="-.", label="raw into spread destinations ÷ raw (at the start)")
    for ax, title in zip(axes, ("decode speed ÷ in-RAM (after warm-up)", "cache hit rate",
                                "read GB/s while reading ÷ raw O_DIRECT")):
        ax.set_xlabel("expert cache budget, % of expert bytes")
        ax.set_title(title)
        if ax is axes[0]:                      # room above 1.0 for the legend, off the curves
            ax.set_ylim(0, 1.85)
            ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{out['model']} — {out['expert_bytes'] / 2**30:.2f} GiB of experts")
    fig.tight_layout()
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, dpi=90)
    return dest
