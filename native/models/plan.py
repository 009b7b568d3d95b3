"""Will a model run here? Memory needed (weights as the engine holds them, KV cache at a
context for each sequence decoded together, runtime) against the RAM psutil says is available,
with a verdict and what to change."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import psutil

from ..arch import family
from ..config import read_config
from ..encoder import MAX_BATCH_TOKENS, is_encoder, read_encoder_config
from ..gguf_file import read_gguf
from ..kernels import COMPILED_TYPES, kernel_info
from ..kv_cache import CHECKPOINTS
from ..kv_types import DEFAULT_KV_TYPE, check_head_dim, kv_type
from ..prefix_cache import auto_ram_bytes
from ..scheduler import DEFAULT_PARALLEL

RUNTIME_BYTES = 120 * 2**20      # Python, numpy, tokenizer, scratch activations (measured ~100 MB)
MIN_EXPERT_CACHE_SLOTS = 2       # per layer: the fewest experts a streamed step can work with


def _weights(g, compiled: bool) -> tuple[Counter, Counter, int]:
    """Bytes per tensor type as stored and as the engine holds them, and the experts' share."""
    by_type: Counter = Counter()
    held: Counter = Counter()
    expert_bytes = 0
    for name, t in g.tensors.items():
        by_type[t.type.name] += t.n_bytes
        engine = t.n_bytes if (compiled and t.type in COMPILED_TYPES) else 4 * t.n_elements
        held[t.type.name] += engine
        if "_exps." in name:
            expert_bytes += engine
    return by_type, held, expert_bytes


DEFAULT_KV = (DEFAULT_KV_TYPE, DEFAULT_KV_TYPE)


def _kv_per_sequence(c, ctx: int, kv: tuple = DEFAULT_KV) -> int:
    """Keys and values of the layers that keep every position (at the cache's types: keys kv[0],
    values kv[1]), the sliding-window layers' window, and the recurrent states of linear-attention
    layers."""
    fam = family(c.arch)
    kb, vb = (kv_type(t).bytes_per_value for t in kv)
    return fam.kv_bytes_per_token(c, kb, vb) * ctx + fam.window_kv_bytes(c, kb, vb) + _recurrent_bytes(c)


def _recurrent_bytes(c) -> int:
    """A sequence's recurrent states: the live one and its checkpoints (kv_cache.py)."""
    return family(c.arch).recurrent_state_bytes(c) * (1 + CHECKPOINTS)


def _prefix_cache_bytes(c, ctx: int, kv: tuple = DEFAULT_KV) -> int:
    """A worker's prefix cache at its default budget (workers/prefix_setup.py) — none for a model
    with sliding-window or recurrent layers, which it does not cache."""
    fam = family(c.arch)
    kb, vb = (kv_type(t).bytes_per_value for t in kv)
    if fam.window_kv_bytes(c, kb, vb) or fam.recurrent_state_bytes(c):
        return 0
    return auto_ram_bytes(int(fam.kv_bytes_per_token(c, kb, vb) * ctx))


def _kv_name(kv: tuple) -> str:
    return kv[0] if kv[0] == kv[1] else f"{kv[0]}/{kv[1]}"


CONTEXT_STEPS = (32768, 16384, 8192, 4096, 2048, 1024, 512)   # what a model is given, at most its trained one
PLAIN_CONTEXT = 4096                                          # without a budget to size it by


def default_context(c, weights: int, budget: int | None, parallel: int, kv: tuple = DEFAULT_KV) -> tuple[int, str]:
    """The context a model gets when none is configured, and why. With a model memory budget, as
    Ollama sizes it by memory: the largest of its trained context (up to 32k), 16k, 8k, 4k, …
    whose weights, KV cache for `parallel` sequences and runtime fit the budget — the model could
    then run with the budget to itself; without one, its trained context up to 4,096."""
    trained = c.n_ctx_train
    if budget is None:
        ctx = min(trained, PLAIN_CONTEXT)
        return ctx, "trained" if ctx == trained else f"of {trained:,} trained: no memory budget to size it by"
    steps = sorted({min(trained, CONTEXT_STEPS[0])} | {s for s in CONTEXT_STEPS if s < trained}, reverse=True)
    for ctx in steps:
        if weights + parallel * _kv_per_sequence(c, ctx, kv) + _prefix_cache_bytes(c, ctx, kv) + RUNTIME_BYTES <= budget:
            if ctx == trained:
                return ctx, "trained"
            capped = " (at most 32,768 unless [models] ctx says more)" if ctx == CONTEXT_STEPS[0] else ""
            return ctx, (f"of {trained:,} trained: the largest whose {_kv_name(kv)} KV cache for {parallel} sequences fits the "
                         f"{budget / 2**30:.2f} GiB model memory budget beside the weights{capped}")
    return steps[-1], f"of {trained:,} trained: the smallest offered; even it does not fit the memory budget"


def vision_bytes(mmproj: Path, compiled: bool) -> int:
    """A vision projector's weights as the engine holds them and the activations of one square
    through its tower (native/vision/encoder.py: every patch's rows, one head's scores at a time)."""
    from ..vision.clip_config import read_vision_config
    g = read_gguf(mmproj, skip_arrays=True)
    c = read_vision_config(g)
    weights = sum(_weights(g, compiled)[1].values())
    if c.dynamic:      # the largest image it takes (mtmd's 4096 rows: 16384 patches), a head's scores at a time
        patches = c.max_pixels // c.patch_size ** 2
        scores = 64 * patches * 4 if compiled else patches * patches * 4
        return weights + patches * (c.n_ff + 8 * c.n_embd) * 4 + scores
    patches = c.patches_per_side ** 2
    return weights + patches * (c.n_ff + 6 * c.n_embd) * 4 + c.n_head * patches * patches * 4


def plan(path: Path, ctx: int | None = None, available: int | None = None, parallel: int | None = None,
         draft: Path | None = None, budget: int | None = None, kv: tuple = DEFAULT_KV,
         mmproj: Path | str | None = None) -> dict:
    """`parallel`: sequences decoded together (a worker's `parallel`, default 4) — each may grow its
    own KV cache to the whole context, so the plan counts that many. `draft`: a worker's
    `draft_model`, whose weights and one KV cache per sequence (the same context) it also holds.
    `ctx` None: default_context's, sized by `budget` when there is one. `kv`: the KV cache's types
    (keys, values): "f16", "q8_0" or "q4_0". `mmproj`: the vision projector (None: the one beside
    the model that fits it, if any; "off": none), its weights and one image's activations counted."""
    parallel = max(1, int(parallel or DEFAULT_PARALLEL))
    g = read_gguf(path, skip_arrays=True)
    if is_encoder(g.architecture):
        return _encoder_plan(path, g, ctx, available)
    c = read_config(g)
    kv = tuple(kv_type(t).name for t in kv)
    for t in kv:
        check_head_dim(kv_type(t), c.head_dim)
    compiled = kernel_info()["path"] == "compiled"
    by_type, held, expert_bytes = _weights(g, compiled)
    weights = sum(held.values())
    ctx, why = (ctx, "configured") if ctx else default_context(c, weights, budget, parallel, kv)
    kv_seq = _kv_per_sequence(c, ctx, kv)
    kv_bytes = kv_seq * parallel
    prefix_bytes = _prefix_cache_bytes(c, ctx, kv)
    draft_bytes = 0
    if draft is not None:
        dg = read_gguf(draft, skip_arrays=True)
        draft_weights = sum(_weights(dg, compiled)[1].values())
        draft_kv = _kv_per_sequence(read_config(dg), ctx) * parallel      # a draft's cache stays fp16
        draft_bytes = draft_weights + draft_kv
    if mmproj is None:
        from .inspect import vision_projector
        mmproj = vision_projector(g)
    mmproj = None if mmproj == "off" else mmproj
    vision = vision_bytes(Path(mmproj), compiled) if mmproj else 0
    total = weights + kv_bytes + prefix_bytes + draft_bytes + vision + RUNTIME_BYTES
    avail = available if available is not None else psutil.virtual_memory().available
    non_expert = weights - expert_bytes
    out = {"model": str(path), "architecture": c.arch, "context": ctx, "context_why": why,
           "kernel_path": "compiled" if compiled else "numpy",
           "weights_stored_bytes": dict(by_type), "weights_held_bytes": dict(held), "weights_bytes": weights,
           "kv_cache_bytes": kv_bytes, "kv_per_sequence_bytes": kv_seq, "kv_types": list(kv), "parallel": parallel,
           "prefix_cache_bytes": prefix_bytes,
           "recurrent_state_bytes": _recurrent_bytes(c),
           "runtime_bytes": RUNTIME_BYTES, "total_bytes": total,
           "expert_bytes": expert_bytes, "non_expert_bytes": non_expert, "available_bytes": avail}
    if draft is not None:
        out.update(draft_model=str(draft), draft_weights_bytes=draft_weights, draft_kv_cache_bytes=draft_kv)
    if mmproj:
        out.update(mmproj=str(mmproj), vision_bytes=vision)
    if total <= 0.9 * avail:
        out["verdict"] = "fits"
        out["advice"] = f"needs {total / 2**30:.2f} GiB of {avail / 2**30:.2f} GiB available"
        return out
    if c.is_moe and non_expert + kv_bytes + prefix_bytes + draft_bytes + RUNTIME_BYTES < 0.9 * avail:
        per_expert = expert_bytes / max(1, c.n_layer * c.n_expert)
        cache = 0.9 * avail - (non_expert + kv_bytes + prefix_bytes + draft_bytes + RUNTIME_BYTES)
        slots = int(cache // per_expert)
        if slots >= MIN_EXPERT_CACHE_SLOTS * c.n_layer:
            frac = min(1.0, slots / (c.n_layer * c.n_expert))
            used = c.n_expert_used / c.n_expert
            out["verdict"] = "streams"
            out["expert_cache_bytes"] = int(cache)
            out["expert_cache_slots"] = slots
            # uniform routing gives the floor; real routers reuse experts, so the hit rate is higher
            out["expected_hit_rate"] = [round(frac, 2), round(min(1.0, frac / used * 0.5 + frac * 0.5), 2)]
            out["advice"] = (f"experts ({expert_bytes / 2**30:.2f} GiB) do not fit; stream them with a "
                             f"{cache / 2**30:.2f} GiB expert cache (a moe-stream worker)")
            return out
    out["verdict"] = "too_large"
    need = total - 0.9 * avail
    tips = [f"needs {total / 2**30:.2f} GiB but {avail / 2**30:.2f} GiB is available ({need / 2**30:.2f} GiB short)"]
    if kv_bytes > need:
        tips.append(f"a context of {max(256, int(ctx * (1 - need / kv_bytes)) // 256 * 256)} tokens would fit (--ctx)")
        if parallel > 1 and kv_seq * (parallel - 1) >= need:
            fewer = max(1, parallel - int(-(-need // kv_seq)))
            tips.append(f"or {fewer} parallel sequence{'s' if fewer > 1 else ''} instead of {parallel} (--parallel)")
    if draft_bytes:
        tips.append(f"or no draft model (it holds {draft_bytes / 2**30:.2f} GiB)")
    tips.append("or use a smaller quantization of this model")
    out["advice"] = "; ".join(tips)
    return out


def _encoder_plan(path: Path, g, ctx: int | None, available: int | None) -> dict:
    """An embedder or reranker: its weights, no KV cache, and the activations of its largest
    forward (MAX_BATCH_TOKENS rows through the FFN, one input's attention scores)."""
    c = read_encoder_config(g)
    compiled = kernel_info()["path"] == "compiled"
    by_type, held, _ = _weights(g, compiled)
    weights = sum(held.values())
    ctx = min(ctx or c.n_ctx_train, c.n_ctx_train)
    activations = MAX_BATCH_TOKENS * (c.n_ff + 6 * c.n_embd) * 4 + c.n_head * ctx * ctx * 4
    total = weights + activations + RUNTIME_BYTES
    avail = available if available is not None else psutil.virtual_memory().available
    fits = total <= 0.9 * avail
    return {"model": str(path), "architecture": c.arch, "encoder": True, "pooling": c.pooling, "context": ctx,
            "context_why": "trained (an encoder's position table)" if ctx == c.n_ctx_train else "configured",
            "kernel_path": "compiled" if compiled else "numpy",
            "weights_stored_bytes": dict(by_type), "weights_held_bytes": dict(held), "weights_bytes": weights,
            "activation_bytes": activations, "kv_cache_bytes": 0, "kv_per_sequence_bytes": 0, "kv_types": [],
            "parallel": 1, "prefix_cache_bytes": 0, "recurrent_state_bytes": 0, "runtime_bytes": RUNTIME_BYTES,
            "total_bytes": total, "expert_bytes": 0, "non_expert_bytes": weights, "available_bytes": avail,
            "verdict": "fits" if fits else "too_large",
            "advice": f"needs {total / 2**30:.2f} GiB of {avail / 2**30:.2f} GiB available" + (
                "" if fits else "; use a smaller quantization of this model")}
