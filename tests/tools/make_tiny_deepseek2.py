"""tests/data/tiny/tiny-deepseek2.gguf (and -v3) and their llama.cpp references: tiny-llama's vocabulary under
DeepSeek-V2-Lite's architecture — multi-head latent attention in the layout current converters
write (attn_kv_a_mqa, attn_k_b, attn_v_b; no low-rank query, as V2-Lite), YaRN as V2-Lite has it
(with its yarn_log_multiplier), layer 0 dense (tiny-llama's FFN), layer 1 routed: 8 experts of 64,
2 used, softmax gating, one shared expert — random F32 weights (seed 2). llama.cpp runs it
through src/models/deepseek2.cpp. tiny-deepseek2-v3 is the same architecture as DeepSeek-V3
configures it: a low-rank query (attn_q_a → norm → attn_q_b), sigmoid gating with a selection
bias, 4 expert groups of which 2 are kept, weights renormalised and scaled by 2.5, no YaRN.
tiny-deepseek2-wide is tiny-deepseek2 with the released models' latent width: kv_lora_rank 512 and
64 rope dimensions, so each cached key row holds 576 values (past the 512 the attention kernels
once took).

    python tests/tools/make_tiny_deepseek2.py
"""

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"
E, H, NOPE, R, VD, C = 128, 4, 16, 16, 32, 64      # embedding, heads, no-rope / rope / value widths, kv rank
X, F = 8, 64                                        # experts, expert width


def build(v3: bool, wide: bool = False) -> Path:
    sys.path.insert(0, str(HERE))
    from gguf_copy import copy_gguf
    global C, R
    C, R = (512, 64) if wide else (64, 16)
    rng = np.random.default_rng(3 if v3 else 4 if wide else 2)
    f32 = lambda *s, scale=None: (rng.standard_normal(s) * (scale or s[-1] ** -0.5)).astype(np.float32)  # noqa: E731
    QR = 32
    add = {}
    for i in (0, 1):
        p = f"blk.{i}."
        q = {p + "attn_q_a.weight": f32(QR, E), p + "attn_q_a_norm.weight": (1 + 0.1 * rng.standard_normal(QR))
             .astype(np.float32), p + "attn_q_b.weight": f32(H * (NOPE + R), QR)} if v3 else \
            {p + "attn_q.weight": f32(H * (NOPE + R), E)}
        add |= q | {p + "attn_kv_a_mqa.weight": f32(C + R, E),
                    p + "attn_kv_a_norm.weight": (1 + 0.1 * rng.standard_normal(C)).astype(np.float32),
                    p + "attn_k_b.weight": f32(H, C, NOPE), p + "attn_v_b.weight": f32(H, VD, C)}
    add |= {"blk.1.ffn_gate_inp.weight": f32(X, E, scale=0.5),
            "blk.1.ffn_gate_exps.weight": f32(X, F, E), "blk.1.ffn_up_exps.weight": f32(X, F, E),
            "blk.1.ffn_down_exps.weight": f32(X, E, F),
            "blk.1.ffn_gate_shexp.weight": f32(F, E), "blk.1.ffn_up_shexp.weight": f32(F, E),
            "blk.1.ffn_down_shexp.weight": f32(E, F)}
    arch = "deepseek2"
    meta = {f"{arch}.attention.head_count_kv": 1,
            f"{arch}.attention.key_length": C + R, f"{arch}.attention.value_length": C,
            f"{arch}.attention.key_length_mla": NOPE + R, f"{arch}.attention.value_length_mla": VD,
            f"{arch}.attention.q_lora_rank": QR if v3 else 0, f"{arch}.attention.kv_lora_rank": C,
            f"{arch}.rope.dimension_count": R, f"{arch}.leading_dense_block_count": 1, f"{arch}.expert_count": X,
            f"{arch}.expert_used_count": 2, f"{arch}.expert_shared_count": 1, f"{arch}.expert_feed_forward_length": F}
    if v3:
        add["blk.1.exp_probs_b.bias"] = (0.05 * rng.standard_normal(X)).astype(np.float32)
        meta |= {"general.name": "tiny-deepseek2-v3", f"{arch}.expert_gating_func": 2,
                 f"{arch}.expert_group_count": 4, f"{arch}.expert_group_used_count": 2,
                 f"{arch}.expert_weights_norm": True, f"{arch}.expert_weights_scale": 2.5}
    else:
        meta |= {"general.name": "tiny-deepseek2-wide" if wide else "tiny-deepseek2", f"{arch}.rope.scaling.type": "yarn",
                 f"{arch}.rope.scaling.factor": 4.0, f"{arch}.rope.scaling.original_context_length": 512,
                 f"{arch}.rope.scaling.yarn_log_multiplier": 0.0707, f"{arch}.expert_weights_scale": 1.0,
                 f"{arch}.expert_gating_func": 1}
    drop = [f"blk.{i}.attn_{t}.weight" for i in (0, 1) for t in ("q", "k", "v")]
    drop += [f"blk.1.ffn_{t}.weight" for t in ("gate", "up", "down")]
    name = "tiny-deepseek2-v3.gguf" if v3 else "tiny-deepseek2-wide.gguf" if wide else "tiny-deepseek2.gguf"
    return copy_gguf(TINY / "tiny-llama.gguf", TINY / name, arch,
                     rename=lambda k: arch + k[len("llama"):] if k.startswith("llama.") else k, drop=drop, add=add,
                     meta=meta)


def main() -> None:
    sys.path.insert(0, str(HERE / "tools"))
    import make_reference
    for v3, wide in ((False, False), (True, False), (False, True)):
        make_reference.tiny_reference(build(v3, wide), HERE / "data" / "prompts_tiny.json")


if __name__ == "__main__":
    main()
