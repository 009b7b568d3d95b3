"""Benchmark models of the sizes people run, made here: random-weight GGUFs of real models' shapes,
written in F16 and quantized with llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`).

Weights are random (text is noise), shapes are real: the matrices, the vocabulary (the head over
128k–262k tokens is part of the cost), the heads and head sizes, the layer count (Phi-3-mini's at a
reduced depth, said in its name). The tokenizer is the default model's byte-level BPE (SmolLM2's
49,152 tokens), cut down or padded with unused tokens to each model's vocabulary, so prompts
tokenize the same way in Kiln and llama.cpp.

    python bench/bench_models.py                          # every shape, Q4_K_M
    python bench/bench_models.py --shape llama-3.2-1b --quant Q4_K_M Q8_0
    python bench/bench_models.py --list

Files go to `.cache/bench-models/` (`--out`); a file already there is kept. The F16 file of each
shape is kept too (the quantizer's input; delete it with `--drop-f16`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".cache" / "bench-models"
STD = 0.02                       # matrices' weight std: activations stay in range through the depth


@dataclass(frozen=True)
class Shape:
    arch: str                    # GGUF architecture name
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab: int
    ctx: int
    rope_base: float
    tied: bool = True            # the LM head is the token embedding (no output.weight)
    sliding_window: int = 0      # gemma3's local layers, gpt-oss's alternate ones
    note: str = ""
    experts: tuple = ()          # (count, used, expert FFN width, shared expert FFN width or 0)
    delta_net: tuple = ()        # qwen35: (key heads, key head size, value heads, value head size)
    rope_dim: int = 0            # rotated dimensions when not all of head_dim (qwen35: a quarter)


SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 8192, 32, 8, 64, 128256, 131072, 500000.0),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 3072, 16, 8, 128, 151936, 40960, 1000000.0),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 6144, 16, 8, 128, 151936, 40960, 1000000.0),
    "gemma-3-270m": Shape("gemma3", 640, 18, 2048, 4, 1, 256, 262144, 32768, 1000000.0, sliding_window=512),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 6912, 4, 1, 256, 262144, 32768, 1000000.0, sliding_window=512),
    "phi-3-mini-8l": Shape("phi3", 3072, 8, 8192, 32, 32, 96, 32064, 4096, 10000.0, tied=False,
                           note="Phi-3-mini's layer at 8 of its 32 layers"),
    # Qwen 3.5: three gated delta-net layers, then one of gated full attention (q and its gate)
    "qwen3.5-0.8b": Shape("qwen35", 1024, 24, 3584, 8, 2, 256, 248320, 262144, 10000000.0,
                          delta_net=(16, 128, 16, 128), rope_dim=64),
    "qwen3.5-2b": Shape("qwen35", 2048, 24, 6144, 8, 2, 256, 248320, 262144, 10000000.0,
                        delta_net=(16, 128, 16, 128), rope_dim=64),
    "qwen3.5-35b-a3b-4l": Shape("qwen35moe", 2048, 4, 512, 16, 2, 256, 248320, 262144, 10000000.0, tied=False,
                                delta_net=(16, 128, 32, 128), rope_dim=64, experts=(256, 8, 512, 512),
                                note="Qwen3.5-35B-A3B's layers at 4 of its 40 (3 delta-net, 1 attention)"),
    "gpt-oss-20b-2l": Shape("gpt-oss", 2880, 2, 2880, 64, 8, 64, 201088, 131072, 150000.0, tied=False,
                            sliding_window=128, experts=(32, 4, 2880, 0),
                            note="gpt-oss-20b's layers at 2 of its 24 (one sliding-window, one full)"),
}

# llama.cpp's file types, by the names people use (llama_cpp.LLAMA_FTYPE_MOSTLY_*); MXFP4_MOE puts
# the experts in MXFP4 and the rest in Q8_0, as gpt-oss is released
QUANTS = ("Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0", "MXFP4_MOE")


def tensors(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in llama.cpp's names; a matrix is (rows out, columns in)."""
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.vocab, s.n_embd))]
    if s.arch == "llama":
        out.append(("rope_freqs.weight", (s.head_dim // 2,)))
    for i in range(s.n_layer):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (s.n_embd,)))
        if s.arch in ("qwen35", "qwen35moe", "gpt-oss"):
            out += _newer_layer(s, i, b)
            continue
        if s.arch == "phi3":
            out += [(b + "attn_qkv.weight", (q + 2 * kv, s.n_embd)), (b + "attn_output.weight", (s.n_embd, q)),
                    (b + "ffn_norm.weight", (s.n_embd,)), (b + "ffn_up.weight", (2 * s.n_ff, s.n_embd)),
                    (b + "ffn_down.weight", (s.n_embd, s.n_ff))]
            continue
        out += [(b + "attn_q.weight", (q, s.n_embd)), (b + "attn_k.weight", (kv, s.n_embd)),
                (b + "attn_v.weight", (kv, s.n_embd))]
        if s.arch in ("qwen3", "gemma3"):
            out += [(b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,))]
        out.append((b + "attn_output.weight", (s.n_embd, q)))
        if s.arch == "gemma3":
            out.append((b + "post_attention_norm.weight", (s.n_embd,)))
        out += [(b + "ffn_norm.weight", (s.n_embd,)), (b + "ffn_gate.weight", (s.n_ff, s.n_embd)),
                (b + "ffn_up.weight", (s.n_ff, s.n_embd)), (b + "ffn_down.weight", (s.n_embd, s.n_ff))]
        if s.arch == "gemma3":
            out.append((b + "post_ffw_norm.weight", (s.n_embd,)))
    out.append(("output_norm.weight", (s.n_embd,)))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.n_embd)))
    return out


def _newer_layer(s: Shape, i: int, b: str) -> list[tuple[str, tuple[int, ...]]]:
    """A Qwen 3.5 or gpt-oss layer's tensors after its attn_norm, as llama.cpp's loader wants them."""
    n, q, kv = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out: list[tuple[str, tuple[int, ...]]] = []
    if s.arch == "gpt-oss":
        for t, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            out += [(b + t + ".weight", (rows, n)), (b + t + ".bias", (rows,))]
        out += [(b + "attn_output.weight", (n, q)), (b + "attn_output.bias", (n,)), (b + "attn_sinks.weight", (s.n_head,))]
    elif i % 4 == 3:                                    # full attention: q with its output gate
        out += [(b + "attn_q.weight", (2 * q, n)), (b + "attn_k.weight", (kv, n)), (b + "attn_v.weight", (kv, n)),
                (b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,)),
                (b + "attn_output.weight", (n, q))]
    else:                                               # gated delta net
        hk, dk, hv, dv = s.delta_net
        conv = 2 * hk * dk + hv * dv
        out += [(b + "attn_qkv.weight", (conv, n)), (b + "attn_gate.weight", (hv * dv, n)),
                (b + "ssm_conv1d.weight", (conv, 4)), (b + "ssm_dt.bias", (hv,)), (b + "ssm_a", (hv,)),
                (b + "ssm_beta.weight", (hv, n)), (b + "ssm_alpha.weight", (hv, n)), (b + "ssm_norm.weight", (dv,)),
                (b + "ssm_out.weight", (n, hv * dv))]
    out.append((b + "post_attention_norm.weight", (n,)))
    if not s.experts:
        return out + [(b + "ffn_gate.weight", (s.n_ff, n)), (b + "ffn_up.weight", (s.n_ff, n)),
                      (b + "ffn_down.weight", (n, s.n_ff))]
    E, _, ff, shared = s.experts
    out += [(b + "ffn_gate_inp.weight", (E, n)), (b + "ffn_gate_exps.weight", (E, ff, n)),
            (b + "ffn_up_exps.weight", (E, ff, n)), (b + "ffn_down_exps.weight", (E, n, ff))]
    if s.arch == "gpt-oss":
        out += [(b + "ffn_gate_inp.bias", (E,)), (b + "ffn_gate_exps.bias", (E, ff)),
                (b + "ffn_up_exps.bias", (E, ff)), (b + "ffn_down_exps.bias", (E, n))]
    if shared:
        out += [(b + "ffn_gate_inp_shexp.weight", (n,)), (b + "ffn_gate_shexp.weight", (shared, n)),
                (b + "ffn_up_shexp.weight", (shared, n)), (b + "ffn_down_shexp.weight", (n, shared))]
    return out


def _f32(tname: str) -> bool:
    """Kept in float32 (as converters write them; the quantizer leaves them so): vectors, biases,
    the router, the short convolution."""
    return tname.endswith((".bias", "_sinks.weight", "ssm_a", "ssm_conv1d.weight", "ffn_gate_inp.weight"))


def vocabulary(n: int) -> dict:
    """The default model's tokenizer fitted to `n` tokens: its first n (and the merges that make
    only those) when n is smaller, else padded with unused tokens no merge or text reaches."""
    from gguf import GGUFReader

    from kiln.native.models.library import resolve_model
    r = GGUFReader(resolve_model("default", pull=True))

    def field(k):
        return r.fields[k].contents()
    tokens, types, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type"), field("tokenizer.ggml.merges")
    if n <= len(tokens):
        # every byte's token stays (byte-level BPE needs all 256; SmolLM2 keeps the rare ones last),
        # then the others in order; ids are renumbered
        single = {i for i, t in enumerate(tokens) if len(t) == 1}
        rest = [i for i in range(len(tokens)) if i not in single][:n - len(single)]
        idx = sorted(single | set(rest))
        tokens, types = [tokens[i] for i in idx], [types[i] for i in idx]
        keep = set(tokens)
        merges = [m for m in merges if "".join(m.split(" ", 1)) in keep and all(p in keep for p in m.split(" ", 1))]
    else:
        tokens = tokens + [f"<unused_{i}>" for i in range(n - len(tokens))]
        types = types + [5] * (n - len(types))          # UNUSED: never matched in text
    return {"tokens": tokens, "types": types, "merges": merges, "pre": field("tokenizer.ggml.pre"),
            "bos": int(field("tokenizer.ggml.bos_token_id")), "eos": int(field("tokenizer.ggml.eos_token_id")),
            "template": field("tokenizer.chat_template")}


def rope_factors(s: Shape) -> np.ndarray:
    """Llama 3.1+'s long-context rope factors (factor 32, low 1, high 4, original context 8192), as
    convert_hf_to_gguf.py computes them."""
    base, dim = s.rope_base, s.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(32.0)
        else:
            smooth = (8192 / wl - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / 32.0 + smooth))
    return np.array(out, dtype=np.float32)


def write_f16(name: str, s: Shape, path: Path, seed: int = 0) -> None:
    """The F16 GGUF, written tensor by tensor (never the whole model in memory)."""
    import gguf
    rng = np.random.default_rng(seed)
    v = vocabulary(s.vocab)
    w = gguf.GGUFWriter(str(path), s.arch)
    a = s.arch
    # llama.cpp switches on Phi-3's tokenizer quirks for names holding "phi-3"/"phi3" and then
    # looks up SentencePiece's "<s>"/"</s>", which this BPE vocabulary lacks
    w.add_name(f"bench {name.replace('phi-3', 'phi 3')} (random weights)")
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(1)                                   # MOSTLY_F16
    if a == "phi3":
        w.add_rope_dimension_count(s.head_dim)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.experts:
        w.add_expert_count(s.experts[0])
        w.add_expert_used_count(s.experts[1])
        w.add_expert_feed_forward_length(s.experts[2])
        if s.experts[3]:
            w.add_expert_shared_feed_forward_length(s.experts[3])
    if s.delta_net:                                      # qwen35: its delta nets and M-RoPE sections
        hk, dk, hv, dv = s.delta_net
        w.add_rope_dimension_count(s.rope_dim)
        w.add_rope_dimension_sections([11, 11, 10, 0])
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(hk)
        w.add_ssm_time_step_rank(hv)
        w.add_ssm_inner_size(hv * dv)
        w.add_uint32(f"{a}.full_attention_interval", 4)
    if a == "gpt-oss":                                   # YaRN to 128k, as released
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    w.add_add_bos_token(False)
    w.add_chat_template(v["template"])
    specs = tensors(s)
    for tname, shape in specs:
        dtype = np.float32 if len(shape) == 1 or _f32(tname) else np.float16
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total, done, t0 = sum(int(np.prod(sh)) for _, sh in specs), 0, time.time()
    for tname, shape in specs:
        if tname == "rope_freqs.weight":
            arr = rope_factors(s)
        elif tname.endswith(("ssm_a", ".bias", "_sinks.weight")):
            arr = np.full(shape, -1.0 if tname.endswith("ssm_a") else 0.0, np.float32)   # decay -1; no offsets
        elif len(shape) == 1:
            arr = np.ones(shape, np.float32)             # norms: identity (gemma's stored weights are 1 + w)
        else:
            arr = np.empty(shape, np.float32 if _f32(tname) else np.float16)
            flat = arr.reshape(-1, shape[-1])
            for r0 in range(0, flat.shape[0], 4096):     # in slices: bounded float32 scratch
                flat[r0:r0 + 4096] = rng.standard_normal((min(4096, flat.shape[0] - r0), shape[-1]), np.float32) * STD
        w.write_tensor_data(arr)
        done += arr.size
        print(f"\r  {path.name}: {done / total:6.1%} ({time.time() - t0:.0f} s)", end="", file=sys.stderr)
    print(file=sys.stderr)
    w.close()


def quantize(src: Path, dst: Path, quant: str, threads: int) -> float:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = threads
    t0 = time.time()
    tmp = dst.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise SystemExit(f"llama.cpp's quantizer failed on {src} → {quant}")
    tmp.rename(dst)
    return time.time() - t0


def model_path(out: Path, name: str, quant: str) -> Path:
    return out / f"{name}.{quant}.gguf"


def make(name: str, quants: list[str], out: Path, threads: int, drop_f16: bool) -> list[dict]:
    s = SHAPES[name]
    out.mkdir(parents=True, exist_ok=True)
    f16 = model_path(out, name, "F16")
    made = []
    todo = [q for q in quants if not model_path(out, name, q).exists()]
    if todo and not f16.exists():
        t0 = time.time()
        tmp = f16.with_suffix(".part")
        write_f16(name, s, tmp)
        tmp.rename(f16)
        made.append({"file": f16.name, "bytes": f16.stat().st_size, "seconds": round(time.time() - t0, 1)})
    for q in quants:
        dst = model_path(out, name, q)
        if dst.exists():
            made.append({"file": dst.name, "bytes": dst.stat().st_size, "kept": True})
            continue
        secs = quantize(f16, dst, q, threads)
        made.append({"file": dst.name, "bytes": dst.stat().st_size, "seconds": round(secs, 1)})
    if drop_f16 and f16.exists():
        f16.unlink()
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="*", choices=sorted(SHAPES), help="shapes to make (default: all)")
    ap.add_argument("--quant", nargs="*", default=["Q4_K_M"], choices=QUANTS)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drop-f16", action="store_true", help="delete each F16 file once its quants are made")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = ap.parse_args()
    if args.list:
        for n, s in SHAPES.items():
            params = sum(int(np.prod(sh)) for _, sh in tensors(s))
            print(json.dumps({"shape": n, "params": params, **s.__dict__}))
        return
    for name in args.shape or list(SHAPES):
        for m in make(name, args.quant, args.out, args.threads, args.drop_f16):
            print(json.dumps({"benchmark": "bench_models", "shape": name, **m}), flush=True)


if __name__ == "__main__":
    main()
