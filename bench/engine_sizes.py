"""`bench/engine.py --suite sizes`: Kiln against llama.cpp on the models of bench/bench_models.py —
every shape × quant found there, prefill at 512 and 2,048 tokens, decode after each, and the
resident memory of each engine. Each measurement runs in a process of its own (so its memory is
its own), Kiln's and llama.cpp's alternating run by run; ratios are medians of the run pairs.
Each engine prefills as it does when serving: Kiln in chunks of PREFILL_CHUNK (256) positions,
llama.cpp in batches of n_batch = 512.
One JSON line per model, then a markdown table (`--table FILE` writes it too).

    python bench/engine.py --suite sizes [--runs 3] [--shape llama-3.2-1b] [--quant Q4_K_M]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "perplexity" / "GPL-3.txt"


def _rss() -> int:
    return psutil.Process().memory_info().rss


def child(engine: str, path: Path, prompts: list[int], decode: int, threads: int) -> dict:
    """One run in this process: load, then for each prompt length a fresh context's prefill and
    `decode` greedy tokens after it."""
    rss0 = _rss()
    t0 = time.perf_counter()
    out: dict = {"engine": engine}
    if engine == "kiln":
        from kiln.native import kernels
        from kiln.native.generate import PREFILL_CHUNK
        from kiln.native.model import load_model
        kernels.set_threads(threads)
        model = load_model(path)
        ids_all = model.tokenizer.encode(TEXT.read_text(), add_bos=False)

        def run(n: int) -> tuple[float, float]:
            ids = ids_all[:n]
            cache = model.new_cache(n + decode + 1)
            t = time.perf_counter()
            for i in range(0, n, PREFILL_CHUNK):        # as a worker prefills a prompt nobody waits on
                logits = model.forward(ids[i:i + PREFILL_CHUNK], cache)
            pre = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(decode):
                logits = model.forward([int(logits.argmax())], cache)
            return pre, time.perf_counter() - t
    else:
        import llama_cpp
        llm = llama_cpp.Llama(str(path), n_ctx=max(prompts) + decode + 8, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, verbose=False)
        ids_all = llm.tokenize(TEXT.read_bytes(), add_bos=False)
        out["version"] = llama_cpp.__version__

        def run(n: int) -> tuple[float, float]:
            llm.reset()
            ids = ids_all[:n]
            t = time.perf_counter()
            llm.eval(ids)
            pre = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(decode):
                llm.eval([llm.sample(temp=0.0)])
            return pre, time.perf_counter() - t
    out["load_s"] = round(time.perf_counter() - t0, 2)
    out["loaded_rss_bytes"] = _rss() - rss0
    for n in prompts:
        if n > len(ids_all):
            raise SystemExit(f"the text has {len(ids_all)} tokens; a {n}-token prompt cannot be made")
        pre, dec = run(n)
        out[f"prefill_{n}_tok_s"] = round(n / pre, 2)
        out[f"decode_after_{n}_tok_s"] = round(decode / dec, 2)
    out["peak_rss_bytes"] = psutil.Process().memory_info().rss
    import resource
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _spawn(engine: str, path: Path, prompts: list[int], decode: int, threads: int) -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--child", engine, str(path), ",".join(map(str, prompts)),
           str(decode), str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"engine": engine, "error": (r.stderr or r.stdout).strip()[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def models(folder: Path, shapes: list[str] | None, quants: list[str] | None) -> list[Path]:
    found = []
    for p in sorted(folder.glob("*.gguf")):
        shape, _, quant = p.stem.rpartition(".")
        if quant == "F16" or (shapes and shape not in shapes) or (quants and quant not in quants):
            continue
        found.append(p)
    return found


def _warm(path: Path) -> None:
    """Read the file once, so it is in the page cache before either engine maps it."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def suite(folder: Path, runs: int, threads: int, prompts: list[int], decode: int,
          shapes: list[str] | None, quants: list[str] | None, table: Path | None) -> None:
    import importlib.util
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    files = models(folder, shapes, quants)
    if not files:
        raise SystemExit(f"no models in {folder}: make them with `python bench/bench_models.py`")
    rows = []
    for path in files:
        shape, _, quant = path.stem.rpartition(".")
        k_runs, l_runs = [], []
        _warm(path)                                  # the first run must not pay for a cold page cache
        for run in range(runs):                      # alternating, so both see the same machine —
            order = ("kiln", "llama_cpp") if run % 2 == 0 else ("llama_cpp", "kiln")   # and each goes first
            for engine in order:
                if engine == "kiln":
                    k_runs.append(_spawn("kiln", path, prompts, decode, threads))
                elif have_llama:
                    l_runs.append(_spawn("llama_cpp", path, prompts, decode, threads))
        line = {"benchmark": "engine_sizes", "shape": shape, "quant": quant, "file_bytes": path.stat().st_size,
                "threads": threads, "runs": runs, "decode_tokens": decode,
                "kiln": _median(k_runs), "llama_cpp": _median(l_runs) if have_llama else "not installed"}
        if have_llama and not any("error" in r for r in k_runs + l_runs):
            line["ratio"] = {k: round(statistics.median(a[k] / b[k] for a, b in zip(k_runs, l_runs)), 2)
                             for k in k_runs[0] if k.endswith("tok_s")}
            line["ratio"]["peak_rss"] = round(statistics.median(a["max_rss_bytes"] / b["max_rss_bytes"]
                                                                for a, b in zip(k_runs, l_runs)), 2)
        print(json.dumps(line), flush=True)
        rows.append(line)
    md = markdown(rows, prompts)
    print(md)
    if table:
        table.write_text(md)


def _median(rs: list[dict]) -> dict:
    errs = [r["error"] for r in rs if "error" in r]
    if errs:
        return {"error": errs[0]}
    out = {k: (round(statistics.median(r[k] for r in rs), 2) if isinstance(rs[0][k], (int, float)) else rs[0][k])
           for k in rs[0]}
    out["runs"] = {k: [r[k] for r in rs] for k in rs[0] if k.endswith("tok_s")}
    return out


def markdown(rows: list[dict], prompts: list[int]) -> str:
    head = ["model", "quant", "file MB"]
    for n in prompts:
        head += [f"prefill {n} K/L", f"decode after {n} K/L"]
    head += ["peak RSS MB K/L"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        k, lc = r["kiln"], r["llama_cpp"]
        if "error" in k or not isinstance(lc, dict) or "error" in lc:
            lines.append(f"| {r['shape']} | {r['quant']} | — | error: {(k.get('error') or str(lc))[:80]} |")
            continue
        cells = [r["shape"], r["quant"], f"{r['file_bytes'] / 1e6:.0f}"]
        for n in prompts:
            for key in (f"prefill_{n}_tok_s", f"decode_after_{n}_tok_s"):
                cells.append(f"{k[key]:.1f} / {lc[key]:.1f} = **{r['ratio'][key]:.2f}×**")
        cells.append(f"{k['max_rss_bytes'] / 1e6:.0f} / {lc['max_rss_bytes'] / 1e6:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    _, _, eng, p, ps, d, th = sys.argv
    print(json.dumps(child(eng, Path(p), [int(x) for x in ps.split(",")], int(d), int(th))))
