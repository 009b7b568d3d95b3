"""Decode speed of a model's weights mapped from the file against a private huge-page copy
(weights = "private", native/private_weights.py), in one process: blocks of 16 decode tokens
alternate between the two models on the same sequence, so the machine's drift falls on both.

The page cache is put in one of two states first — `large`: the file read whole (on Linux ≥ 6.16
ext4 and on XFS the page cache then holds large folios, mapped by 2 MiB where they can be);
`small`: evicted, then every page faulted through a MADV_RANDOM mapping (4 KiB folios: what ext4
gives before Linux 6.16, Debian 12 and 13) — `--state both` runs each. Prints JSON.

    python bench/private_weights.py [MODEL.gguf ...] [--state small|large|both] [--rounds 16]

Without models: the default model, the MoE-fied SmolLM2 of the tests and the expert-streaming
bench's MoE when they are in .cache/.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_stream_disk import file_pmd_mapped  # noqa: E402


def page_cache(path: Path, state: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if state == "large":
            while os.read(fd, 64 << 20):
                pass
            return
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        m.madvise(mmap.MADV_RANDOM)                       # no readahead: one 4 KiB folio per fault
        for off in range(0, size, mmap.PAGESIZE):
            m[off]
        m.close()
    finally:
        os.close(fd)


def compare(path: Path, state: str, rounds: int, block: int = 16) -> dict:
    from kiln.native.model import load_model
    page_cache(path, state)
    models = {"mapped": load_model(path), "private": load_model(path, weights="private")}
    c = models["mapped"].config
    steps = np.random.default_rng(7).integers(0, c.n_vocab, 8 + rounds * block).tolist()
    kv = {k: m.new_cache(len(steps) + 8) for k, m in models.items()}
    for k, m in models.items():
        m.forward(steps[:8], kv[k])
    times: dict = {"mapped": [], "private": []}
    at = 8
    for r in range(rounds):
        for k in ("mapped", "private") if r % 2 == 0 else ("private", "mapped"):
            t = time.perf_counter()
            for tok in steps[at:at + block]:
                models[k].forward([tok], kv[k])
            times[k].append((time.perf_counter() - t) / block)
        at += block
    ratios = [a / b for a, b in zip(times["mapped"], times["private"])]
    return {"model": path.name, "page_cache": state, "file_bytes": path.stat().st_size,
            "file_pmd_mapped_bytes": file_pmd_mapped(), "private": models["private"].gguf.private.stats(),
            "mapped_tok_s": round(1 / statistics.median(times["mapped"]), 2),
            "private_tok_s": round(1 / statistics.median(times["private"]), 2),
            "private_vs_mapped": round(statistics.median(ratios), 3),
            "blocks": [round(x, 3) for x in ratios]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--state", choices=("small", "large", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    models = args.models or [p for p in (ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
                                         ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct-MoE-E8K2.gguf",
                                         ROOT / ".cache" / "bench" / "synthetic-moe-v3-L16-E64K4-d1024-ff1536.gguf")
                             if p.exists()]
    if not models:
        sys.exit("no model given and none in .cache/ (run the tests or bench/moe_stream.py once)")
    states = ("small", "large") if args.state == "both" else (args.state,)
    runs = []
    for path in models:
        for state in states:                             # each in its own process: one page-cache state each
            r = subprocess.run([sys.executable, __file__, "--one", str(path), state, str(args.rounds)],
                               capture_output=True, text=True, check=True)
            runs.append(json.loads(r.stdout))
    print(json.dumps({"benchmark": "private_weights", "runs": runs}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(compare(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))))
    else:
        main()
