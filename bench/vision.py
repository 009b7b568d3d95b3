"""Image encoding against llama.cpp's libmtmd (llama-cpp-python 0.3.36) in the same run: one square
through the vision tower and projector, Kiln's encoder against mtmd_encode_chunk, same threads.

The projectors are random-weight F16 mmproj files of real towers' shapes, written under clip.cpp's
names (tests/tools/make_tiny_vision.py) into `.cache/bench-models/`:
  smolvlm   SmolVLM-256M's SigLIP-B/16 at 512 px: 12 layers, 768 wide, FFN 3072, 1,024 patches a tile
  gemma3    Gemma 3's SigLIP-So400m/14 at 896 px, cut to --layers (27 in the real one): 1152 wide,
            FFN 4304, 4,096 patches (the time scales with the layers)
  qwen25vl  Qwen2.5-VL-3B/7B's tower, cut to --layers (32): 1280 wide, FFN 3420 (SwiGLU), patch 14,
            window attention but every 8th layer; a 672×672 image: 2,304 patches, 576 rows
  qwen3vl   Qwen3-VL-2B's tower, cut to --layers (24): 1024 wide, FFN 4096, patch 16, a 48×48
            position table, 2 deepstack layers (3 in the real one: the tiny text model reads 2); a
            672×672 image: 1,764 patches, 441 rows
Their projection maps to a tiny text model's width (mtmd requires the text model's): its cost is nil.

    python bench/vision.py                    # both, 3 runs each
    python bench/vision.py --which smolvlm --runs 5 --threads 2

One JSON line per projector: seconds per square of each (median), the ratio (llama.cpp's time over
Kiln's: above 1 Kiln is faster), and the cosine of the two embeddings.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tools"))
OUT = ROOT / ".cache" / "bench-models"
VISION = ROOT / "tests" / "data" / "vision"
SHAPES = {"smolvlm": dict(projector="idefics3", image_size=512, patch=16, merge=4, n_embd=768, n_ff=3072, n_head=12,
                          n_layer=12, extra={"clip.vision.preproc_image_size": 512}),
          "gemma3": dict(projector="gemma3", image_size=896, patch=14, merge=4, n_embd=1152, n_ff=4304, n_head=16,
                         n_layer=27, extra={}),
          "qwen25vl": dict(n_embd=1280, n_ff=3420, n_head=16, n_layer=32, patch=14, wa_pattern=8),
          "qwen3vl": dict(n_embd=1024, n_ff=4096, n_head=16, n_layer=24, patch=16, image_size=768, deepstack=(5, 11))}
TEXT = {"smolvlm": "tiny-smolvlm", "gemma3": "tiny-smolvlm", "qwen25vl": "tiny-qwen25vl", "qwen3vl": "tiny-qwen3vl"}
SIDE = {"smolvlm": 512, "gemma3": 896, "qwen25vl": 672, "qwen3vl": 672}       # the image's (one square's) side


def build(which: str, layers: int | None) -> Path:
    from make_tiny_vision import mmproj, mmproj_qwen3vl, mmproj_qwen25vl
    shape = dict(SHAPES[which])
    if layers:
        shape["n_layer"] = layers
        if "deepstack" in shape:
            shape["deepstack"] = tuple(i * layers // SHAPES[which]["n_layer"] for i in shape["deepstack"])
    path = OUT / f"mmproj-bench-{which}-L{shape['n_layer']}.F16.gguf"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        if which == "qwen25vl":
            mmproj_qwen25vl(path, n_text=128, seed=3, **shape)
        elif which == "qwen3vl":
            mmproj_qwen3vl(path, n_text=128, seed=3, **shape)
        else:
            mmproj(path, shape.pop("projector"), n_text=128, seed=3, **shape)
    return path


def image(side: int) -> bytes:
    import io
    from PIL import Image
    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:side, 0:side]
    rgb = np.clip(np.stack([x, y, x + y], -1) * 255.0 / (2 * side) + rng.normal(0, 30, (side, side, 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8), "RGB").save(buf, "PNG")
    return buf.getvalue()


def kiln_time(path: Path, data: bytes, runs: int, threads: int) -> tuple[float, np.ndarray]:
    from kiln.native import kernels
    from kiln.native.vision import load_vision
    kernels.set_threads(threads)
    enc = load_vision(path, threads=threads)
    square = enc.read(data).squares[0]
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = enc.encode(square)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def mtmd_time(path: Path, data: bytes, runs: int, threads: int, which: str) -> tuple[float, np.ndarray]:
    import llama_cpp
    from llama_cpp import mtmd_cpp as M
    from PIL import Image
    import io
    llm = llama_cpp.Llama(str(VISION / f"{TEXT[which]}.gguf"), n_ctx=4096, n_threads=threads, n_batch=2048,
                          verbose=False)
    width = llama_cpp.llama_model_n_embd_inp(llm.model)
    params = M.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.warmup = False, threads, False
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = M.mtmd_init_from_file(str(path).encode(), llm.model, params)
    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    bitmap = M.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes()))
    text = M.mtmd_input_text()
    raw = b"<__media__>"
    text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), False, True
    chunks = M.mtmd_input_chunks_init()
    assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    chunk = next(M.mtmd_input_chunks_get(chunks, i) for i in range(M.mtmd_input_chunks_size(chunks))
                 if M.mtmd_input_chunk_get_type(chunk := M.mtmd_input_chunks_get(chunks, i)) != M.MTMD_INPUT_CHUNK_TYPE_TEXT)
    n = M.mtmd_input_chunk_get_n_tokens(chunk)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        assert M.mtmd_encode_chunk(ctx, chunk) == 0
        times.append(time.perf_counter() - t0)
    out = np.ctypeslib.as_array(M.mtmd_get_output_embd(ctx), shape=(n * width,)).reshape(n, width).copy()
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bitmap)
    M.mtmd_free(ctx)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--which", choices=sorted(SHAPES), action="append")
    ap.add_argument("--layers", type=int, default=None, help="cut the tower to this many layers (default: gemma3 6, "
                                                               "the Qwen towers 8)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for which in a.which or ["smolvlm", "gemma3", "qwen25vl", "qwen3vl"]:
        layers = a.layers or {"gemma3": 6, "qwen25vl": 8, "qwen3vl": 8}.get(which)
        path = build(which, layers)
        side = SIDE[which]
        data = image(side)                 # one square: SmolVLM's one tile, Gemma 3's whole image
        k, kv = kiln_time(path, data, a.runs, a.threads)
        m, mv = mtmd_time(path, data, a.runs, a.threads, which)
        cos = float((kv.ravel() @ mv.ravel()) / np.linalg.norm(kv) / np.linalg.norm(mv))
        print(json.dumps({"projector": which, "layers": layers or SHAPES[which]["n_layer"], "side": side,
                          "patches": (side // SHAPES[which]["patch"]) ** 2, "threads": a.threads, "runs": a.runs,
                          "kiln_s": round(k, 3), "llama_cpp_s": round(m, 3), "llama_cpp_over_kiln": round(m / k, 2),
                          "cosine": round(cos, 6), "bits_equal": bool(np.array_equal(kv, mv))}), flush=True)


if __name__ == "__main__":
    main()
