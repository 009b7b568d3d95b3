"""tests/data/tiny/tiny-ernie4_5-moe.gguf and its llama.cpp reference: tiny-llama's attention and
vocabulary under ERNIE 4.5 MoE's architecture name; layer 0 dense (tiny-llama's FFN, the one
leading dense layer), layer 1 routed — 8 experts of 64, 2 used, a selection bias (exp_probs_b) and a shared
expert of 64 — random F32 weights (seed 45). llama.cpp
runs it through src/models/ernie4-5-moe.cpp.

    python tests/tools/make_tiny_ernie_moe.py
"""

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"


def main() -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "tools"))
    import make_reference
    from gguf_copy import copy_gguf
    rng = np.random.default_rng(45)
    E, X, F = 128, 8, 64
    f32 = lambda *s, scale=None: (rng.standard_normal(s) * (scale or s[-1] ** -0.5)).astype(np.float32)  # noqa: E731
    add = {"blk.1.ffn_gate_inp.weight": f32(X, E, scale=0.5),
           "blk.1.exp_probs_b.bias": (0.05 * rng.standard_normal(X)).astype(np.float32),
           "blk.1.ffn_gate_exps.weight": f32(X, F, E), "blk.1.ffn_up_exps.weight": f32(X, F, E),
           "blk.1.ffn_down_exps.weight": f32(X, E, F),
           "blk.1.ffn_gate_shexp.weight": f32(F, E), "blk.1.ffn_up_shexp.weight": f32(F, E),
           "blk.1.ffn_down_shexp.weight": f32(E, F)}
    arch = "ernie4_5-moe"
    out = copy_gguf(TINY / "tiny-llama.gguf", TINY / "tiny-ernie4_5-moe.gguf", arch,
                    rename=lambda k: arch + k[len("llama"):] if k.startswith("llama.") else k,
                    drop=[f"blk.1.ffn_{t}.weight" for t in ("gate", "up", "down")], add=add,
                    meta={"general.name": "tiny-ernie4_5-moe", f"{arch}.expert_count": X, f"{arch}.expert_used_count": 2,
                          f"{arch}.expert_feed_forward_length": F, f"{arch}.expert_shared_feed_forward_length": F,
                          f"{arch}.interleave_moe_layer_step": 1, f"{arch}.leading_dense_block_count": 1})
    make_reference.tiny_reference(out, HERE / "data" / "prompts_tiny.json")


if __name__ == "__main__":
    main()
