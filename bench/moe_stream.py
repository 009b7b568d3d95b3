"""MoE expert streaming on a synthetic model larger than a laptop's patience: JSON + a PNG plot.

Builds (once, into .cache/bench/) a random-weight Mixtral-style llama MoE — by default 16
layers × 64 experts (4 used), n_embd 1024, expert FFN 1536, Q4_0: 2.7 GB of experts — then, in
one run:
- the disk's raw O_DIRECT read throughput on that file: large aligned sequential reads and
  1 MiB reads at random aligned offsets;
- in-RAM decode speed (the file memory-mapped and paged in);
- streamed decode for expert-cache budgets of 10/25/50/100 % of the expert bytes, with the LRU
  and the LFU (with aging) policies: tok/s, hit rate, bytes read per token, read GB/s, I/O ms
  per token.

    python bench/moe_stream.py [--tokens 16] [--budgets 10,25,50,100] [--policies lru,lfu]
                               [--layers 16 --experts 64 --used 4 --embd 1024 --ff 1536] [--plot F.png]

The plot needs matplotlib (`pip install matplotlib`); without it the JSON is still printed.
Random router weights route nearly uniformly, so the hit rate tracks the budget and the two
policies differ little here; real models route with skew, where frequency helps more. Decode
steps feed a fixed pseudo-random token sequence (see `decode`).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FROM = ROOT / "tests" / "data" / "tiny" / "tiny-llama.gguf"


def q4_0_random(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """Random Q4_0 blocks (fp16 scale + 16 bytes of nibbles) for a (rows, cols) matrix."""
    nb = rows * cols // 32
    blocks = np.empty((nb, 18), np.uint8)
    blocks[:, :2] = np.full(nb, scale, np.float16).view(np.uint8).reshape(nb, 2)
    # nibbles 1..15, values q - 8 in -7..7: zero mean (0..15 would give every weight a -0.5 bias,
    # a common direction that grows through the layers until every token routes alike)
    lo, hi = rng.integers(1, 16, (2, nb, 16), dtype=np.uint8)
    blocks[:, 2:] = lo | (hi << 4)
    return blocks.reshape(rows, cols // 32 * 18)


def build_model(path: Path, layers: int, experts: int, used: int, embd: int, ff: int, seed: int = 0) -> Path:
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = GGUFReader(TOKENIZER_FROM)
    n_vocab = len(tok.fields["tokenizer.ggml.tokens"].contents())
    head_dim, n_head = 128, embd // 128
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(tmp, "llama")
    w.add_string("general.name", f"synthetic MoE L{layers} E{experts}K{used}")
    for key, val in {"context_length": 2048, "embedding_length": embd, "block_count": layers,
                     "feed_forward_length": ff, "attention.head_count": n_head, "attention.head_count_kv": n_head,
                     "expert_count": experts, "expert_used_count": used}.items():
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in tok.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(key, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    plan = [("token_embd.weight", (n_vocab, embd), "q4"), ("output_norm.weight", (embd,), "norm")]
    for i in range(layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (embd,), "norm"), (p + "attn_q.weight", (embd, embd), "q4"),
                 (p + "attn_k.weight", (embd, embd), "q4"), (p + "attn_v.weight", (embd, embd), "q4"),
                 (p + "attn_output.weight", (embd, embd), "q4"), (p + "ffn_norm.weight", (embd,), "norm"),
                 (p + "ffn_gate_inp.weight", (experts, embd), "router"),
                 (p + "ffn_gate_exps.weight", (experts, ff, embd), "q4"),
                 (p + "ffn_up_exps.weight", (experts, ff, embd), "q4"),
                 (p + "ffn_down_exps.weight", (experts, embd, ff), "q4")]
    for name, shape, kind in plan:
        if kind == "q4":
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // 32 * 18), np.dtype(np.uint8),
                              int(np.prod(shape)) // 32 * 18, raw_dtype=Q.Q4_0)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in plan:
        if kind == "norm":
            data = np.ones(shape, np.float32)
        elif kind == "router":
            data = rng.normal(0, 1.0, shape).astype(np.float32)
        else:
            rows = int(np.prod(shape[:-1]))
            # weights of std ~1/sqrt(n_in) (a value q - 8 has std 4.3): the residual stream
            # stays in scale, so the router sees different inputs and picks different experts
            scale = 1.0 / (4.3 * np.sqrt(shape[-1]))
            data = q4_0_random(rng, rows, shape[-1], scale).reshape(*shape[:-1], -1)
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, path)
    return path


def raw_direct_reads(path: Path, seq_bytes: int = 1 << 30, chunk: int = 8 << 20, n_random: int = 256) -> dict:
    """O_DIRECT read throughput of the file's disk: sequential chunks, and 1 MiB random reads."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    buf = mmap.mmap(-1, chunk)
    try:
        n = min(seq_bytes, size // chunk * chunk)
        t = time.perf_counter()
        for off in range(0, n, chunk):
            os.preadv(fd, [buf], off)
        seq = n / (time.perf_counter() - t)
        mib = memoryview(buf)[:1 << 20]
        rnd = random.Random(1)
        offs = [rnd.randrange(0, size - (1 << 20)) // 4096 * 4096 for _ in range(n_random)]
        t = time.perf_counter()
        for off in offs:
            os.preadv(fd, [mib], off)
        ran = n_random * (1 << 20) / (time.perf_counter() - t)
    finally:
        os.close(fd)
    return {"sequential_gb_s": round(seq / 1e9, 3), "sequential_chunk_mib": chunk >> 20,
            "random_1mib_gb_s": round(ran / 1e9, 3), "random_reads": n_random}


def decode(model, prompt: list[int], n: int, after_prefill=lambda: None) -> float:
    """Decode steps of one token each. The tokens are a fixed pseudo-random sequence, not the
    model's argmax: a random-weight model's greedy output repeats one token, and the same token
    routes to the same experts every step, which would measure nothing but cache hits."""
    cache = model.new_cache(len(prompt) + n + 1)
    model.forward(prompt, cache)
    after_prefill()
    steps = np.random.default_rng(7).integers(0, model.config.n_vocab, n).tolist()
    t = time.perf_counter()
    for tok in steps:
        model.forward([tok], cache)
    return n / (time.perf_counter() - t)


def decode_stats(cache, before: dict) -> dict:
    """The cache's figures for the decode steps only (the prompt's prefill excluded)."""
    hits, misses = cache.hits - before["hits"], cache.misses - before["misses"]
    nbytes, secs = cache.bytes_read - before["bytes"], cache.read_seconds - before["secs"]
    tokens = cache.tokens - before["tokens"]
    return {"hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
            "bytes_read_per_token": round(nbytes / tokens) if tokens else None,
            "read_gb_s": round(nbytes / secs / 1e9, 3) if secs else None,
            "io_ms_per_token": round(1000 * secs / tokens, 2) if tokens else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=1536)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--budgets", default="10,25,50,100")
    ap.add_argument("--policies", default="lru,lfu")
    ap.add_argument("--plot", default=str(ROOT / ".cache" / "bench" / "moe_stream.png"))
    args = ap.parse_args()

    from kiln.native.expert_store import ExpertCache, ExpertStore
    from kiln.native.model import load_model

    name = f"synthetic-moe-v3-L{args.layers}-E{args.experts}K{args.used}-d{args.embd}-ff{args.ff}.gguf"
    t = time.perf_counter()
    path = build_model(ROOT / ".cache" / "bench" / name, args.layers, args.experts, args.used, args.embd, args.ff)
    build_s = time.perf_counter() - t
    model = load_model(path)
    prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)[:24]
    out = {"benchmark": "moe_stream", "model": name, "file_bytes": path.stat().st_size, "build_s": round(build_s, 1),
           "layers": args.layers, "experts": args.experts, "used": args.used, "decode_tokens": args.tokens,
           "disk": raw_direct_reads(path)}
    decode(model, prompt, 2)                                 # page the file in
    out["in_ram_tok_s"] = round(statistics.median(decode(model, prompt, args.tokens) for _ in range(2)), 2)
    store = ExpertStore(path, direct=True)
    probe = ExpertCache(model.gguf, store, 1)
    total_slots = args.layers * args.experts
    out["expert_bytes"] = total_slots * probe.slot_bytes
    out["io_mode"] = store.io_mode
    runs = []
    for policy in args.policies.split(","):
        for pct in (int(b) for b in args.budgets.split(",")):
            slots = max(1, total_slots * pct // 100)
            cache = ExpertCache(model.gguf, store, slots, policy=policy)
            model.expert_provider = cache
            before = {}

            def mark(c=cache, b=before):
                b.update(hits=c.hits, misses=c.misses, bytes=c.bytes_read, secs=c.read_seconds, tokens=c.tokens)
            tok_s = decode(model, prompt, args.tokens, mark)
            runs.append({"policy": policy, "budget_pct": pct, "slots": slots, "tok_s": round(tok_s, 2),
                         **decode_stats(cache, before)})
            model.expert_provider = None
            cache.pool.shutdown()
    out["streamed"] = runs
    out["plot"] = plot(out, args.plot)
    print(json.dumps(out, indent=1))


def plot(out: dict, dest: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for policy in sorted({r["policy"] for r in out["streamed"]}):
        rs = [r for r in out["streamed"] if r["policy"] == policy]
        x = [r["budget_pct"] for r in rs]
        axes[0].plot(x, [r["tok_s"] for r in rs], "o-", label=f"streamed ({policy})")
        axes[1].plot(x, [r["hit_rate"] for r in rs], "o-", label=policy)
        axes[2].plot(x, [(r["read_gb_s"] or 0) for r in rs], "o-", label=f"cache reads ({policy})")
    axes[0].axhline(out["in_ram_tok_s"], color="grey", ls="--", label="in RAM")
    axes[2].axhline(out["disk"]["sequential_gb_s"], color="grey", ls="--", label="raw O_DIRECT sequential")
    axes[2].axhline(out["disk"]["random_1mib_gb_s"], color="grey", ls=":", label="raw O_DIRECT 1 MiB random")
    for ax, title in zip(axes, ("decode tok/s", "cache hit rate", "read GB/s")):
        ax.set_xlabel("expert cache budget, % of expert bytes")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{out['model']} — {out['expert_bytes'] / 2**30:.2f} GiB of experts, io {out['io_mode']}")
    fig.tight_layout()
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, dpi=90)
    return dest


if __name__ == "__main__":
    main()
