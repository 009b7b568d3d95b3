"""Serving numbers, as JSON: time to first token and decode tok/s through HTTP (stream) vs
the engine alone for the same prompt, the overhead per request and per token, aggregate tok/s
with 1, 4 and 8 concurrent streaming clients, and one stream's inter-token gaps (p50/p99/max)
alone and while a ~450-token prompt arrives mid-stream, with that prompt's time to first token.

    python bench/serve.py [--model default|PATH] [--runs 5] [--tokens 64] [--parallel 4]
"""

from __future__ import annotations

import argparse
import http.client
import os
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemon_harness import Daemon  # noqa: E402

os.environ.setdefault("GOMP_SPINCOUNT", "30000")     # as the supervisor starts workers; before OpenMP loads

def question(i: int) -> list[dict]:
    """A distinct prompt per run, so no run reuses another's KV cache."""
    return [{"role": "user", "content": f"Write a short story about lighthouse keeper number {i}."}]


def stream(base: str, tokens: int, i: int, stamps: list | None = None,
           speculative: bool = True) -> tuple[float, float, int]:
    """(time to first token, total time, tokens) for one streaming chat request; `stamps`, if
    given, gets the absolute times (perf_counter) of the first and the last token."""
    host, port = base.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"messages": question(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "speculative": speculative}
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    first, n = None, 0
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        ev = json.loads(line[6:])
        if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
            first = first or time.perf_counter() - t0
        if ev.get("usage"):
            n = ev["usage"]["completion_tokens"]
    c.close()
    end = time.perf_counter()
    if stamps is not None:
        stamps.append((t0 + first, end))
    return first, end - t0, n


def stream_gaps(base: str, tokens: int, i: int, started: threading.Event | None = None) -> list[float]:
    """Arrival times of every content chunk of one streamed chat (perf_counter)."""
    host, port = base.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"messages": question(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    times = []
    for line in c.getresponse():
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
                if started is not None and len(times) == 20:
                    started.set()
    c.close()
    return times


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def long_prompt_interference(base: str, runs: int) -> dict:
    """One stream's inter-token gaps alone, and while a 400-token prompt arrives mid-stream
    (chunked prefill keeps the stream going); the long prompt's time to first token."""
    text = (Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity" / "GPL-3.txt").read_text()
    host, port = base.removeprefix("http://").split(":")
    out = {"alone": [], "with_long_prompt": [], "long_ttft": []}
    for run in range(runs):
        t = stream_gaps(base, 150, 5000 + run)
        out["alone"] += [b - a for a, b in zip(t, t[1:])]
        started = threading.Event()
        got: dict = {}
        th = threading.Thread(target=lambda: got.update(t=stream_gaps(base, 150, 6000 + run, started)))
        th.start()
        started.wait(60)
        c = http.client.HTTPConnection(host, int(port), timeout=600)
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", json.dumps({"prompt": text[run * 40:run * 40 + 2000], "max_tokens": 1,
                                                         "temperature": 0}), {"Content-Type": "application/json"})
        r = json.loads(c.getresponse().read())
        out["long_ttft"].append(time.perf_counter() - t0)
        c.close()
        th.join()
        out["with_long_prompt"] += [b - a for a, b in zip(got["t"], got["t"][1:])]
        out.setdefault("long_prompt_tokens", r["usage"]["prompt_tokens"])
    res = {"long_prompt_tokens": out["long_prompt_tokens"],
           "long_prompt_ttft_s": round(statistics.median(out["long_ttft"]), 2)}
    for k in ("alone", "with_long_prompt"):
        g = out[k]
        res[k] = {"itl_p50_ms": round(1000 * pct(g, 50), 1), "itl_p99_ms": round(1000 * pct(g, 99), 1),
                  "itl_max_ms": round(1000 * max(g), 1)}
    res["worst_over_median"] = round(res["with_long_prompt"]["itl_max_ms"] / res["with_long_prompt"]["itl_p50_ms"], 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=4, help="the worker's `parallel` setting (sequences decoded together)")
    args = ap.parse_args()
    from kiln.native.chat_template import render_and_tokenize, template_for
    from kiln.native.generate import Sequence
    from kiln.native.models.library import resolve_model
    from kiln.native.model import load_model
    from kiln.native.sampling import SamplingParams
    path = resolve_model(args.model, pull=args.model == "default")
    model = load_model(path)
    seq = Sequence(model)            # one cache, as the worker's slots: the template prefix is reused
    seq.generate(render_and_tokenize(template_for(model), model.tokenizer, question(999))[1],
                 SamplingParams(max_tokens=1)).__next__()

    def engine_run(i: int) -> tuple[float, float]:
        ids = render_and_tokenize(template_for(model), model.tokenizer, question(i))[1]
        t0 = time.perf_counter()
        first = None
        for ev in seq.generate(ids, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)):
            first = first or time.perf_counter() - t0
        total = time.perf_counter() - t0
        return first, (args.tokens - 1) / (total - first)
    n_prompt = len(render_and_tokenize(template_for(model), model.tokenizer, question(1000))[1])
    out = {"benchmark": "serve", "model": path.name, "prompt_tokens": n_prompt, "completion_tokens": args.tokens}
    with tempfile.TemporaryDirectory() as home:
        d = Daemon(Path(home), {"default": {"kind": "inference", "model": str(path),
                                            "settings": {"parallel": args.parallel}}},
                   supervisor={"heartbeat_interval": 1.0}).start()
        try:
            d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=120, what="model loaded")
            stream(d.http, 4, 0)
            # the engine in this process and the same request through HTTP, run by run (pairs):
            # the machine's drift hits both; drafting off in both, so only the serving path differs
            eng_ttft, eng_rate, ttft, rate = [], [], [], []
            for run in range(args.runs):
                f, r = engine_run(1000 + run)
                eng_ttft.append(f)
                eng_rate.append(r)
                f, total, n = stream(d.http, args.tokens, 1000 + run, speculative=False)
                ttft.append(f)
                rate.append((n - 1) / (total - f))
            out["engine"] = {"ttft_ms": round(statistics.median(eng_ttft) * 1000, 1),
                             "decode_tok_s": round(statistics.median(eng_rate), 1)}
            h_ttft, h_rate = statistics.median(ttft), statistics.median(rate)
            out["http"] = {"ttft_ms": round(h_ttft * 1000, 1), "decode_tok_s": round(h_rate, 1),
                           "decode_vs_engine": round(statistics.median(b / a for a, b in zip(eng_rate, rate)), 2)}
            out["overhead"] = {"per_request_ms": round((h_ttft - statistics.median(eng_ttft)) * 1000, 1),
                               "per_token_ms": round((1 / h_rate - 1 / statistics.median(eng_rate)) * 1000, 2)}
            agg, dec = {}, {}
            for clients in (1, 4, 8):
                totals, decodes = [], []
                for run in range(args.runs):
                    counts, stamps = [0] * clients, []
                    def one(i):
                        counts[i] = stream(d.http, args.tokens, 2000 + 100 * clients + 10 * run + i, stamps,
                                           speculative=False)[2]     # batching alone: drafts run only solo
                    t0 = time.perf_counter()
                    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    totals.append(sum(counts) / (time.perf_counter() - t0))
                    # decode only: the tokens after each stream's first, over the span from the
                    # first first-token to the last end (prefills are not decode)
                    span = max(e for _, e in stamps) - min(f for f, _ in stamps)
                    decodes.append((sum(counts) - clients) / span)
                agg[str(clients)] = round(statistics.median(totals), 1)
                dec[str(clients)] = round(statistics.median(decodes), 1)
            out["aggregate_tok_s"] = agg
            out["aggregate_decode_tok_s"] = dec
            out["aggregate_ratio_4_vs_1"] = round(agg["4"] / agg["1"], 2)
            out["aggregate_decode_ratio_4_vs_1"] = round(dec["4"] / dec["1"], 2)
            out["long_prompt_mid_stream"] = long_prompt_interference(d.http, max(1, args.runs // 2))
            out["parallel"] = args.parallel
            out["aggregate_note"] = ("the worker batches the decode steps of up to `parallel` requests; "
                                     "prompts are prefilled in chunks between decode steps; aggregate_tok_s counts every token "
                                     "over the whole wall time, aggregate_decode_tok_s the tokens after the "
                                     "first of each stream over the decode span; medians of --runs")
        finally:
            d.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
