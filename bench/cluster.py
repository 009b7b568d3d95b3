"""Kiln on a Ray cluster of several nodes on this machine (issue 41), as JSON:

- split: the default model split in two stages on two nodes (`split = 2`) against the whole
  model in one process, the same daemon — greedy decode tok/s of one stream (runs interleaved,
  medians), whether the text is identical (it must be), a 700-token prompt's time to the first
  token (on one machine the stages do not overlap a prompt's parts: `pipeline_prefill = auto`),
  and what the split costs per decode call:
  bytes crossing each way, time waiting for the later stage, its compute, and the rest — the
  hop (first stage → supervisor → stage and back, over loopback TCP with CURVE here; on a LAN
  add twice its latency per call);
- replicas: 8 clients against one copy of the model and against two copies on two nodes —
  total tok/s. On one machine the copies share its cores, so this shows the router's spread
  and its cost, not the gain two machines would give.

    python bench/cluster.py [--runs 3] [--tokens 160]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_harness import Daemon  # noqa: E402

MiB = 2**20
PROMPT = "Tell me a long story about a dragon who learns to bake bread."


def stream(d: Daemon, model: str, tokens: int, text: str = PROMPT) -> tuple[float, str, int]:
    """(decode tok/s after the first token, the text, tokens) of one greedy streamed answer."""
    body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}
    req = urllib.request.Request(d.http + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    parts, first, n = [], None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            if raw.startswith(b"data: {"):
                ev = json.loads(raw[6:])
                if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                    n += 1
                    parts.append(ev["choices"][0]["delta"]["content"])
                    first = first or time.perf_counter()
    return (n - 1) / (time.perf_counter() - first), "".join(parts), n


def stats(d: Daemon, worker: str) -> dict:
    return d.command("call", {"worker": worker, "op": "stats"})


LONG = "Summarize this: " + " ".join(f"On day {i} the baker made {i * 3} loaves of rye bread." for i in range(40))


def first_token_s(d: Daemon, model: str, run: int) -> float:
    """Seconds to the first token of a ~700-token prompt (its prefill: through both stages of a
    split model in parts, each stage computing while the other does); a new first word each run,
    so no prompt cache serves it."""
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": f"Run {run}. {LONG}"}]}
    req = urllib.request.Request(d.http + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    urllib.request.urlopen(req, timeout=600).read()
    return time.perf_counter() - t0


def bench_split(d: Daemon, runs: int, tokens: int) -> dict:
    whole, split, same = [], [], True
    pre_whole, pre_split = [], []
    f0, s0 = stats(d, "sp"), stats(d, "sp.stage1")
    n_split = 0
    for _ in range(runs):
        w, tw, _ = stream(d, "whole", tokens)
        s, ts, n = stream(d, "sp", tokens)
        whole.append(w)
        split.append(s)
        n_split += n
        same = same and tw == ts
    f1, s1 = stats(d, "sp"), stats(d, "sp.stage1")          # the decode runs' calls alone
    for _ in range(runs):
        pre_whole.append(first_token_s(d, "whole", len(pre_whole)))
        pre_split.append(first_token_s(d, "sp", len(pre_split)))
    calls = f1["stage_calls"] - f0["stage_calls"]
    wait = f1["stage_wait_s"] - f0["stage_wait_s"]
    compute = s1["compute_s"] - s0["compute_s"]
    return {"whole_tok_s": round(statistics.median(whole), 1), "split_tok_s": round(statistics.median(split), 1),
            "ratio": round(statistics.median(split) / statistics.median(whole), 3), "text_identical": same,
            "prefill_700_tokens_s": {"whole": round(statistics.median(pre_whole), 3),
                                     "split": round(statistics.median(pre_split), 3),
                                     "ratio": round(statistics.median(pre_whole) / statistics.median(pre_split), 3)},
            "calls": calls, "tokens": n_split,
            "bytes_per_call_out": round((f1["stage_bytes_out"] - f0["stage_bytes_out"]) / calls),
            "bytes_per_call_in": round((f1["stage_bytes_in"] - f0["stage_bytes_in"]) / calls),
            "wait_ms_per_call": round(1000 * wait / calls, 2), "stage_compute_ms_per_call": round(1000 * compute / calls, 2),
            "hop_ms_per_call": round(1000 * (wait - compute) / calls, 2),
            "nodes": {"first": d.worker("sp")["node"], "later": d.worker("sp.stage1")["node"]}}


def bench_replicas(d: Daemon, model: str, tokens: int) -> float:
    """Total tok/s of 8 clients at once."""
    counts = [0] * 8

    def one(i):
        counts[i] = stream(d, model, tokens, f"{PROMPT} Chapter {i}.")[2]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args()
    from ray.cluster_utils import Cluster
    from kiln.native.models.library import pull_default
    model = str(pull_default(ROOT / ".cache" / "models"))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "memory": 300 * MiB})
    for _ in range(2):
        c.add_node(num_cpus=1, memory=2048 * MiB)
    c.wait_for_nodes()
    out = {"machine_cores": os.cpu_count()}
    try:
        with tempfile.TemporaryDirectory() as home:
            workers = {"whole": {"kind": "inference", "model": model, "settings": {"ctx": 2048}},
                       "sp": {"kind": "inference", "model": model, "split": 2, "settings": {"ctx": 2048}},
                       "r2": {"kind": "inference", "model": model, "replicas": 2, "settings": {"ctx": 2048}}}
            d = Daemon(Path(home), workers, supervisor={"heartbeat_interval": 0.5, "liveness": 6},
                       extra_args=("--cluster", c.address))
            d.start(timeout=120)
            try:
                d.wait(lambda st: all(w["worker_state"] == "ready" for w in st["workers"]), 120, "workers ready")
                stream(d, "whole", 8), stream(d, "sp", 8)              # warm
                out["split"] = bench_split(d, args.runs, args.tokens)
                one = statistics.median(bench_replicas(d, "whole", args.tokens // 2) for _ in range(args.runs))
                two = statistics.median(bench_replicas(d, "r2", args.tokens // 2) for _ in range(args.runs))
                sent = d.status()["router"]["sent"]
                out["replicas"] = {"one_copy_tok_s": round(one, 1), "two_copies_tok_s": round(two, 1),
                                   "ratio": round(two / one, 3),
                                   "sent": {k: v for k, v in sent.items() if k.startswith("r2")},
                                   "nodes": [d.worker("r2")["node"], d.worker("r2.2")["node"]]}
            finally:
                d.stop()
    finally:
        c.shutdown()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
