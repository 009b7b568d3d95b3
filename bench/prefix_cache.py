"""Time to first token for a long agent prompt, as JSON, through a real daemon: cold (nothing
cached), for a second conversation with the same system prompt (its blocks in RAM), and after
the daemon is stopped and started again (its blocks read back from disk,
KILN_HOME/cache/prefix). Each is a chat request with max_tokens 1 timed from send to answer;
the daemon's own numbers (cached_tokens, the prefix cache's counters) are reported beside.

    python bench/prefix_cache.py [--model default|PATH] [--tokens 20000] [--kv-type f16] [--runs 3]

The system prompt is a tool catalogue of about --tokens tokens (a coding agent's first request
is ~20,000 tokens of instructions and tools). The cold run prefills all of it once — minutes on
2 cores; the others are medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemon_harness import Daemon  # noqa: E402

os.environ.setdefault("GOMP_SPINCOUNT", "30000")


def catalogue(n_tools: int) -> str:
    lines = [f"Tool {i}: `tool_{i}(path: str, depth: int = {i % 7})` reads the file at path and returns its "
             f"{['lines', 'words', 'symbols', 'imports'][i % 4]} up to depth; it fails when path is "
             f"outside the workspace." for i in range(n_tools)]
    return "You are a coding agent. These are your tools.\n" + "\n".join(lines)


def ask(d, system: str, question: str) -> tuple[float, dict]:
    body = {"model": "default", "temperature": 0, "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    req = urllib.request.Request(d.http + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:     # a cold 20k prompt: minutes
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"request failed: {e.code} {e.read()[:500]!r}") from None
    return time.perf_counter() - t, out["usage"]


def prefix_stats(d) -> dict:
    w = next(w for w in d.status()["workers"] if w["name"] == "default")
    return w["stats"].get("prefix_cache") or {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from kiln.native.models.library import resolve_model
    path = Path(resolve_model(args.model, pull=args.model == "default"))
    from kiln.native.model import load_model
    tok = load_model(path).tokenizer
    per_tool = len(tok.encode(catalogue(100))) / 100
    system = catalogue(max(1, int(args.tokens / per_tool)))
    ctx = -(-(len(tok.encode(system)) + 2048) // 1024) * 1024
    workers = {"default": {"kind": "inference", "model": str(path),
                           "settings": {"ctx": ctx, "kv_type": args.kv_type, "parallel": 2}}}
    out = {"benchmark": "prefix_cache", "model": path.name, "kv_type": args.kv_type, "ctx": ctx}
    with tempfile.TemporaryDirectory() as home:
        def up() -> Daemon:
            d = Daemon(Path(home), workers, supervisor={"heartbeat_interval": 1.0}).start()
            d.wait(lambda st: st["workers"][0]["worker_state"] == "ready" and prefix_stats(d).get("disk"),
                   timeout=300, what="model loaded and identified")
            return d
        d = up()
        try:
            cold, usage = ask(d, system, "Which tool counts imports?")
            out["prompt_tokens"] = usage["prompt_tokens"]
            out["cold_s"] = round(cold, 3)
            out["cold_cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
            ram = []
            for i in range(args.runs):                 # other conversations, the same system prompt
                took, usage = ask(d, system, f"Which tool reads words, number {i}?")
                ram.append(took)
            out["second_conversation_s"] = round(statistics.median(ram), 3)
            out["second_conversation_cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
            d.wait(lambda st: prefix_stats(d).get("written", 0) >= out["prompt_tokens"] // 64 - 1, timeout=300,
                   what="blocks written")
        finally:
            d.stop()
        disk, hits = [], []
        for i in range(args.runs):                     # a restarted daemon: an empty RAM cache each time
            d = up()
            try:
                took, usage = ask(d, system, "Which tool counts imports?")
                disk.append(took)
                hits.append(prefix_stats(d))
            finally:
                d.stop()
        out["after_restart_s"] = round(statistics.median(disk), 3)
        out["after_restart_cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
        out["after_restart_prefix_cache"] = {k: hits[-1].get(k) for k in ("hits_disk", "rejected", "reused_tokens")}
        out["speedup_restart_vs_cold"] = round(cold / out["after_restart_s"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
