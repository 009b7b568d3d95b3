"""Editor code completion through /infill, as llama.vim drives it, as JSON: how long a completion
takes when the other files were sent ahead (n_predict 0) against when they were not, and while
the user types on (each keystroke a new request whose prefix the cache already holds).

The default model has no fill-in-the-middle markers, so the bench gives it StarCoder's: SmolLM2
inherited StarCoder's special tokens and renamed four of them, and this copy names four of its
unused specials back (`<fim_prefix>`, `<fim_suffix>`, `<fim_middle>`, `<fim_pad>`). It is not
trained for infilling — what it writes is not a good completion — but it costs what a 135M code
model costs, which is what this measures. Numbers are medians of `--runs` sessions, each in a
fresh worker cache (a new file name in the prompt).

    python bench/infill.py [--runs 5] [--files 8] [--lines 40] [--predict 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from daemon_harness import Daemon  # noqa: E402
from fim_model import rename_tokens  # noqa: E402

os.environ.setdefault("GOMP_SPINCOUNT", "30000")     # as the supervisor starts workers
RENAME = {"<filename>": "<fim_prefix>", "<gh_stars>": "<fim_suffix>", "<issue_start>": "<fim_middle>",
          "<issue_comment>": "<fim_pad>"}


def fim_variant(src: Path, out: Path) -> Path:
    if not out.exists():
        from gguf import GGUFReader
        tokens = list(GGUFReader(src).get_field("tokenizer.ggml.tokens").contents())
        rename_tokens(src, out.with_suffix(".tmp"), {tokens.index(old): new for old, new in RENAME.items()})
        os.replace(out.with_suffix(".tmp"), out)
    return out


def post(base: str, body: dict) -> tuple[float, dict]:
    req = urllib.request.Request(base + "/infill", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return (time.perf_counter() - t) * 1000, out


def session(base: str, run: int, files: int, lines: int, predict: int, warm: bool) -> dict:
    """Other files (ahead of time if `warm`), then a completion, then five keystrokes."""
    text = (ROOT / "native" / "sampling.py").read_text().splitlines()
    # the run in the files' text too: a model without a file separator gets no file names
    # (llama-server's snippet separator), and a session must not find another's files cached
    extra = [{"filename": f"run{run}/file{i}.py",
              "text": f"# run {run}\n" + "\n".join(text[i * lines:(i + 1) * lines]) + "\n"} for i in range(files)]
    prefix = f"# run {run} {'warm' if warm else 'cold'}\n" + "\n".join(text[200:240]) + "\n"
    suffix = "\n".join(text[241:250]) + "\n"
    fields = ["content", "tokens_cached", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n"]
    base_body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "top_k": 40, "top_p": 0.99,
                 "samplers": ["top_k", "top_p", "infill"], "seed": run, "response_fields": fields,
                 "t_max_prompt_ms": 500, "t_max_predict_ms": 1500}
    out = {}
    if warm:
        out["warm_up_ms"], _ = post(base, {**base_body, "input_prefix": "", "input_suffix": "", "prompt": "",
                                           "n_predict": 0, "samplers": [], "response_fields": [""]})
    typed = "    def "
    ms, first = post(base, {**base_body, "prompt": typed, "n_predict": predict})
    out["first_ms"], out["first_prompt_n"], out["first_cached"] = round(ms, 1), first["timings/prompt_n"], \
        first["tokens_cached"]
    keys = []
    for ch in "sample":                                 # the user types on
        typed += ch
        ms, r = post(base, {**base_body, "prompt": typed, "n_predict": predict})
        keys.append((ms, r["timings/prompt_n"]))
    out["keystroke_ms"] = round(statistics.median(k[0] for k in keys), 1)
    out["keystroke_prompt_n"] = statistics.median(k[1] for k in keys)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--predict", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8192)
    args = ap.parse_args()
    from kiln.native.models.library import resolve_model
    cache = ROOT / ".cache" / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    model = fim_variant(resolve_model("default", pull=True), cache / "smollm2-fim-markers.gguf")
    with tempfile.TemporaryDirectory() as home, \
            Daemon(Path(home), {"coder": {"kind": "inference", "model": str(model),
                                          "settings": {"ctx": args.ctx}}}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=120, what="model loaded")
        post(d.http, {"input_prefix": "x", "n_predict": 1})             # page in the weights
        warm = [session(d.http, i, args.files, args.lines, args.predict, True) for i in range(args.runs)]
        cold = [session(d.http, 100 + i, args.files, args.lines, args.predict, False) for i in range(args.runs)]
    med = lambda rs, k: round(statistics.median(r[k] for r in rs), 1)  # noqa: E731
    print(json.dumps({
        "benchmark": "infill", "model": model.name, "ctx": args.ctx, "runs": args.runs, "files": args.files,
        "predict": args.predict,
        "other_files_sent_ahead": {"warm_up_ms": med(warm, "warm_up_ms"), "first_ms": med(warm, "first_ms"),
                                   "first_prompt_tokens_computed": med(warm, "first_prompt_n"),
                                   "first_tokens_cached": med(warm, "first_cached"),
                                   "keystroke_ms": med(warm, "keystroke_ms"),
                                   "keystroke_prompt_tokens_computed": med(warm, "keystroke_prompt_n")},
        "other_files_with_the_first_request": {"first_ms": med(cold, "first_ms"),
                                               "first_prompt_tokens_computed": med(cold, "first_prompt_n"),
                                               "keystroke_ms": med(cold, "keystroke_ms")},
        "first_completion_speedup": round(med(cold, "first_ms") / med(warm, "first_ms"), 2),
        "sessions": {"warm": warm, "cold": cold}}))


if __name__ == "__main__":
    main()
