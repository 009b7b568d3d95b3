"""Kiln's quantizer against llama.cpp's on a model of a real size, in the same run.

    python bench/quantize.py                                   # llama-3.2-1b F16 -> Q4_K_M, 3 runs each
    python bench/quantize.py --shape qwen3-0.6b --type Q4_K_M Q8_0 --runs 1

The F16 input comes from bench/bench_models.py (made there if missing). Each run quantizes in a
process of its own, llama.cpp's (`llama_cpp.llama_model_quantize`, llama-quantize's code) and
Kiln's (`kiln models quantize`) alternating, both with the same thread count, the input warm in the
page cache. Prints one JSON line per file type: the median seconds of each, their ratio, and whether
the two outputs are the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

LLAMA = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3]); p.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""
KILN = """
import sys
from kiln.native.models.quantize import quantize_model
quantize_model(sys.argv[1], sys.argv[2], sys.argv[3], threads=int(sys.argv[4]), force=True)
"""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def timed(code: str, src: Path, dst: Path, ftype: str, threads: int) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, str(src), str(dst), ftype, str(threads)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        raise SystemExit(f"quantizing {src.name} -> {ftype} failed:\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    import bench_models
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(bench_models.SHAPES))
    ap.add_argument("--type", nargs="+", default=["Q4_K_M"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    src = bench_models.model_path(bench_models.OUT, args.shape, "F16")
    if not src.exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        bench_models.write_f16(args.shape, bench_models.SHAPES[args.shape], src)
    subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True)         # warm the page cache
    with tempfile.TemporaryDirectory(dir=bench_models.OUT) as tmp:
        for ftype in args.type:
            ref, out = Path(tmp) / "llama.gguf", Path(tmp) / "kiln.gguf"
            t_ref, t_kiln = [], []
            for _ in range(args.runs):
                t_ref.append(timed(LLAMA, src, ref, ftype, args.threads))
                t_kiln.append(timed(KILN, src, out, ftype, args.threads))
            same = ref.stat().st_size == out.stat().st_size and sha256(ref) == sha256(out)
            m_ref, m_kiln = statistics.median(t_ref), statistics.median(t_kiln)
            print(json.dumps({"shape": args.shape, "type": ftype, "threads": args.threads, "runs": args.runs,
                              "llama_cpp_s": round(m_ref, 2), "kiln_s": round(m_kiln, 2),
                              "kiln_over_llama_cpp": round(m_kiln / m_ref, 3), "bytes": out.stat().st_size,
                              "identical": same}), flush=True)


if __name__ == "__main__":
    main()
