"""What a model file is and what the engine will need to run it — from the header alone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..arch import family
from ..fim import find_fim_tokens
from ..config import read_config
from ..encoder import is_encoder, read_encoder_config
from ..gguf_file import read_gguf
from ..kernels import COMPILED_TYPES, SUPPORTED_TYPES, kernel_info
from ..kv_cache import KV_DTYPE
from ..kv_types import KV_TYPE_NAMES, KV_TYPES


def vision_projector(g) -> Path | None:
    """The mmproj beside the model that fits it (a projector Kiln runs, giving rows of the model's
    width — with Qwen3-VL's deepstack slices — and whose image tokens the vocabulary has) — what
    the inference worker pairs it with, judged from the files' metadata."""
    from ..gguf_file import GGUFError
    from ..vision.clip_config import read_vision_config
    from ..vision.layout import AROUND
    from .hub_refs import mmprojs_beside
    arch = g.architecture
    width = g.get(f"{arch}.embedding_length")
    reads = width * (1 + (g.get(f"{arch}.n_deepstack_layers") or 0)) if isinstance(width, int) else None
    vocab = g.metadata.get("tokenizer.ggml.tokens")
    for p in mmprojs_beside(Path(g.path)):
        try:
            c = read_vision_config(read_gguf(p, skip_arrays=True))
        except (GGUFError, OSError, ValueError):
            continue
        markup = AROUND.get(c.projector, ("<fake_token_around_image>", "<global-img>"))
        if c.n_text == width and c.row_width == reads and (
                not isinstance(vocab, (list, tuple)) or all(t in vocab for t in markup)):
            return p
    return None


def capabilities(g) -> list[str]:
    """What a model can be asked, from its file, as Ollama's `capabilities` names it: an encoder
    embeds or reranks; a chat model completes, and takes tools (any chat template: Kiln
    describes them to one that knows none), thinks (<think> in its template), fills in the middle
    (FIM markers), and embeds when its file names a pooling (Qwen3-Embedding) — or reranks when
    that pooling is rank (Qwen3-Reranker). `g` read with its arrays."""
    arch = g.architecture
    if is_encoder(arch):
        return ["rerank"] if g.get(f"{arch}.pooling_type") == 4 else ["embedding"]
    template = g.get("tokenizer.chat_template") or ""
    caps = ["completion"] + (["tools"] if template else []) + (["thinking"] if "<think>" in template else [])
    caps += ["insert"] if fim_markers(g) else []
    pooling = g.get(f"{arch}.pooling_type")
    caps += ["vision"] if vision_projector(g) else []
    return caps + (["rerank"] if pooling == 4 else ["embedding"] if pooling is not None else [])


def inspect_model(path: Path, *, tensors: bool = False, ctx: int | None = None) -> dict:
    g = read_gguf(path)
    if is_encoder(g.architecture):
        info = _inspect_encoder(path, g)
    else:
        info = _inspect_decoder(path, g, ctx)
    info["capabilities"] = capabilities(g)
    if tensors:
        info["tensors"] = [{"name": t.name, "type": t.type.name, "shape": list(t.shape),
                            "offset": t.offset, "bytes": t.n_bytes, "part": t.part + 1} for t in g.tensors.values()]
    return info


def _common(path: Path, g) -> dict:
    kinfo = kernel_info()
    return {"path": str(path), "parameters": sum(t.n_elements for t in g.tensors.values()), "file_bytes": g.file_size,
            # a split model's files, in order, with their sizes (one entry for a whole file)
            "parts": [{"path": str(p), "bytes": p.stat().st_size} for p in (g.parts or (g.path,))],
            "tensor_types": dict(Counter(t.type.name for t in g.tensors.values()).most_common()),
            "tokenizer": {"model": g.get("tokenizer.ggml.model"), "pre": g.get("tokenizer.ggml.pre"),
                          "tokens": len(g.get("tokenizer.ggml.tokens", [])),
                          "add_bos": bool(g.get("tokenizer.ggml.add_bos_token", False))},
            "kernel_path": kinfo["path"], "kernels": kinfo,
            "unsupported_tensor_types": sorted({t.type.name for t in g.tensors.values()}
                                               - {t.name for t in SUPPORTED_TYPES})}


def _inspect_encoder(path: Path, g) -> dict:
    """An embedder or reranker (native/encoder.py): no KV cache; its pooling says what it answers."""
    c = read_encoder_config(g)
    info = _common(path, g)
    weights = (sum(t.n_bytes if t.type in COMPILED_TYPES else 4 * t.n_elements for t in g.tensors.values())
               if info["kernel_path"] == "compiled" else 4 * info["parameters"])
    return {**info, "name": c.name, "architecture": c.arch,
            "family": {"name": c.arch, "needs": f"a bidirectional encoder pooled by {c.pooling}"},
            "pooling": c.pooling, "context_length": c.n_ctx_train, "layers": c.n_layer, "embedding": c.n_embd,
            "heads": c.n_head, "kv_heads": c.n_head, "head_dim": c.head_dim, "feed_forward": c.n_ff,
            "vocab_size": c.n_vocab, "rope": None, "tied_output": False, "moe": None, "chat_template": False,
            "fill_in_the_middle": False,
            "memory": {"weights_bytes": weights, "kv_cache_bytes_per_token": 0, "kv_cache_bytes_per_token_by_type": {},
                       "context": c.n_ctx_train, "kv_cache_bytes": 0, "recurrent_state_bytes": 0,
                       "total_bytes": weights}}


def _inspect_decoder(path: Path, g, ctx: int | None) -> dict:
    c = read_config(g)
    fam = family(c.arch)
    info = _common(path, g)
    # Compiled path: the stored blocks, memory-mapped (types without a kernel as float32);
    # numpy path: every tensor as float32 (the tied head shares token_embd).
    if info["kernel_path"] == "compiled":
        engine_weights = sum(t.n_bytes if t.type in COMPILED_TYPES else 4 * t.n_elements
                             for t in g.tensors.values())
    else:
        engine_weights = 4 * info["parameters"]
    ctx = ctx or min(c.n_ctx_train, 4096)
    kv_per_token = fam.kv_bytes_per_token(c, KV_DTYPE.itemsize)
    expert_bytes = sum(t.n_bytes for n, t in g.tensors.items() if "_exps." in n)
    window = fam.window_kv_bytes(c, KV_DTYPE.itemsize)
    return {
        **info, "name": c.name, "architecture": c.arch,
        "family": {"name": fam.name, "needs": fam.needs(c, g), **fam.facts(c)},
        "context_length": c.n_ctx_train,
        "layers": c.n_layer, "embedding": c.n_embd, "heads": c.n_head, "kv_heads": c.n_head_kv,
        "head_dim": c.head_dim, "feed_forward": c.n_ff, "vocab_size": c.n_vocab,
        "rope": {"style": c.rope_style, "base": c.rope_base, "scale": c.rope_scale},
        "tied_output": "output.weight" not in g.tensors,
        "moe": {"experts": c.n_expert, "experts_used": c.n_expert_used,
                "expert_ff": c.n_ff_expert, "expert_bytes": expert_bytes} if c.is_moe else None,
        "chat_template": bool(g.get("tokenizer.chat_template")),
        # code infilling (native/fim.py): the model has the prefix/suffix/middle markers
        "fill_in_the_middle": fim_markers(g) is not None,
        "memory": {
            "weights_bytes": engine_weights,
            "kv_cache_bytes_per_token": kv_per_token,
            # what each KV cache type (a worker's kv_type) would take per position
            "kv_cache_bytes_per_token_by_type": {
                n: fam.kv_bytes_per_token(c, KV_TYPES[n].bytes_per_value)
                for n in KV_TYPE_NAMES if c.head_dim % KV_TYPES[n].block == 0},
            "context": ctx,
            "kv_cache_bytes": kv_per_token * ctx + window,
            "recurrent_state_bytes": fam.recurrent_state_bytes(c),
            "total_bytes": engine_weights + kv_per_token * ctx + window + fam.recurrent_state_bytes(c),
        },
    }


def fim_markers(g) -> tuple[str, str, str] | None:
    """The prefix, suffix and middle markers of a model that fills in the middle (native/fim.py),
    else None. `g` read with its arrays (the vocabulary)."""
    tokens = g.get("tokenizer.ggml.tokens") or []
    f = find_fim_tokens(g.metadata, {t: i for i, t in enumerate(tokens)})[0]
    return (tokens[f.pre], tokens[f.suf], tokens[f.mid]) if f.can_infill else None
