"""Serving throughput on the default model, as JSON, in the engine's scheduler (no HTTP):

- stall: a 400-token prompt arrives while a stream decodes — the stream's worst and median
  inter-token gap, with chunked prefill between decode steps (the default) and with the whole
  prompt prefilled at once (as before), and the long prompt's time to first token in each;
- speculation: prompt-lookup drafting on a repetitive task (rewrite code with one change) and on
  free chat, greedy and sampled — decode tok/s with and without, runs interleaved, medians, and
  whether the text is identical (it must be);
- shared CPUs: one stream's decode tok/s quiet, and with a CPU-bound process competing for the
  cores (the scheduler computes on the cores other processes leave; the OpenMP spin setting the
  workers get, GOMP_SPINCOUNT=30000, is applied here too).

    python bench/throughput.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "30000")     # as the supervisor starts workers; before OpenMP loads

ROOT = Path(__file__).resolve().parent.parent
CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Return the perimeter of a rectangle."""
    return 2 * (width + height)


def describe(width, height):
    return f"{width} x {height}: area {area(width, height)}, perimeter {perimeter(width, height)}"
'''
# The repetitive task as a user pastes code (a fenced block): SmolLM2-135M's greedy answer copies
# it nearly whole. "loose_rewrite" (code with docstrings, unfenced) is one it rewrites freely —
# dropping the docstrings and blank lines — so only ~40 % of its answer can be drafted.
PLAIN_CODE = "\n".join(line for line in CODE.splitlines() if '"""' not in line) + "\n"
TASKS = {"repetitive": f"Rewrite this code, renaming width to w and changing nothing else:\n\n```python\n{PLAIN_CODE}```",
         "loose_rewrite": f"Rewrite this code, renaming width to w and changing nothing else:\n\n{CODE}",
         "free_chat": "Tell me about the history of lighthouses."}


def collect(job):
    from kiln.native.generate import Finish, Token
    ids, stamps = [], []
    while True:
        ev = job.events.get(timeout=600)
        if isinstance(ev, Token):
            ids.append(ev.id)
            stamps.append(time.perf_counter())
        elif isinstance(ev, Finish):
            return ids, stamps, ev
        else:
            raise ev


def stall(model, runs: int) -> dict:
    from kiln.native.sampling import SamplingParams
    from kiln.native.scheduler import Scheduler
    tok = model.tokenizer
    long_prompt = tok.encode((ROOT / "tests" / "data" / "perplexity" / "GPL-3.txt").read_text())[:400]
    short = tok.encode("Once upon a time")
    out = {}
    for mode, kw in (("chunked", {}), ("whole_prompt", {"prefill_chunk": 512})):
        worst, med, ttft = [], [], []
        for _ in range(runs):
            s = Scheduler(model, 4096, 4, speculative=False, **kw)
            first = s.submit(short, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True), lambda: False)
            got: dict = {}
            th = threading.Thread(target=lambda: got.update(r=collect(first)))
            th.start()
            while first.events.qsize() < 1 and not got:
                time.sleep(0.005)
            time.sleep(0.4)                          # the stream is under way
            t0 = time.perf_counter()
            _, stamps2, _ = collect(s.submit(long_prompt, SamplingParams(temperature=0, max_tokens=4), lambda: False))
            ttft.append(stamps2[0] - t0)
            th.join()
            stamps = got["r"][1]
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            worst.append(max(gaps))
            med.append(statistics.median(gaps))
        out[mode] = {"median_gap_ms": round(1e3 * statistics.median(med), 1), "worst_gap_ms": round(1e3 * statistics.median(worst), 1),
                     "worst_over_median": round(statistics.median(w / m for w, m in zip(worst, med)), 2),
                     "long_prompt_ttft_s": round(statistics.median(ttft), 2)}
    return out


def speculation(model, runs: int) -> dict:
    from kiln.native.chat_template import render_and_tokenize, template_for
    from kiln.native.sampling import SamplingParams
    from kiln.native.scheduler import Scheduler
    tpl = template_for(model)
    warm = render_and_tokenize(tpl, model.tokenizer, [{"role": "user", "content": "Write a poem about the sea."}])[1]
    out = {}
    for task, text in TASKS.items():
        prompt = render_and_tokenize(tpl, model.tokenizer, [{"role": "user", "content": text}])[1]
        for label, kw in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 5})):
            # one scheduler, as a worker keeps one: its measured forward costs and the drafts'
            # kept-rates carry from request to request — warmed by an unrelated request (untimed)
            s = Scheduler(model, 4096, 1, speculative=True)
            collect(s.submit(warm, SamplingParams(max_tokens=96, speculative=True, **kw), lambda: False))
            rates = {False: [], True: []}
            texts = {False: set(), True: set()}
            acc = None
            for _ in range(runs):
                for spec in (False, True):              # interleaved: noise hits both
                    ids, stamps, fin = collect(s.submit(prompt, SamplingParams(max_tokens=160, speculative=spec, **kw),
                                                        lambda: False))
                    rates[spec].append((len(ids) - 1) / (stamps[-1] - stamps[0]))
                    texts[spec].add(tuple(ids))
                    if spec:
                        acc = (fin.drafted, fin.accepted)
            out[f"{task}_{label}"] = {
                "plain_tok_s": round(statistics.median(rates[False]), 1), "speculative_tok_s": round(statistics.median(rates[True]), 1),
                "speedup": round(statistics.median(b / a for a, b in zip(rates[False], rates[True])), 2),
                "drafted": acc[0], "accepted": acc[1], "acceptance": round(acc[1] / acc[0], 2) if acc[0] else None,
                "identical_text": texts[False] == texts[True] and len(texts[True]) == 1}
    return out


def shared_cpu(model, runs: int) -> dict:
    from kiln.native.sampling import SamplingParams
    from kiln.native.scheduler import Scheduler
    prompt = model.tokenizer.encode("Once upon a time")

    def rate():
        s = Scheduler(model, 4096, 1, speculative=False)
        ids, stamps, _ = collect(s.submit(prompt, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True), lambda: False))
        return (len(ids) - 1) / (stamps[-1] - stamps[0])
    quiet, busy = [], []
    for _ in range(runs):
        quiet.append(rate())
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            busy.append(rate())
        finally:
            hog.kill()
            hog.wait()
    q, b = statistics.median(quiet), statistics.median(busy)
    return {"quiet_tok_s": round(q, 1), "with_a_cpu_hog_tok_s": round(b, 1), "ratio": round(b / q, 2),
            "cores": os.cpu_count(), "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from kiln.native.model import load_model
    from kiln.native.models.library import resolve_model
    model = load_model(resolve_model("default"))
    print(json.dumps({"model": model.path.stem, "stall": stall(model, args.runs),
                      "speculation": speculation(model, args.runs), "shared_cpu": shared_cpu(model, args.runs)},
                     indent=2))


if __name__ == "__main__":
    main()
