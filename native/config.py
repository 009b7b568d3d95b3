"""Typed model configuration read from GGUF metadata (`<arch>.*` keys)."""

from __future__ import annotations

from dataclasses import dataclass

from .arch import UnknownArchitecture, family, supported
from .gguf_file import GGUFError, GGUFFile

@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_style: str                 # "normal" (adjacent pairs) or "neox" (rotate half)
    rope_scale: float               # position scaling factor (1.0 = none)
    n_vocab: int
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_expert: int = 0
    n_ff_shared: int = 0
    expert_weights_norm: bool = False
    extra: tuple = ()               # the family's own hyperparameters, as (key, value) pairs
    rope_scaling: str = "none"      # "none", "linear" or "yarn"
    yarn: tuple = ()                # (n_ctx_orig, beta_fast, beta_slow, attn_factor) with YaRN
    n_ctx_orig: int = 0             # rope.scaling.original_context_length (0: not in the file)
    rope_attn_factor: float = 1.0   # rope.scaling.attn_factor: cos/sin scale (Phi-3 longrope, YaRN)

    def get(self, name: str, default=None):
        return dict(self.extra).get(name, default)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


def read_config(g: GGUFFile) -> ModelConfig:
    arch = g.architecture
    try:
        fam = family(arch)
    except UnknownArchitecture:
        raise GGUFError(f"{g.path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(supported())})") from None

    def key(name, default=None, required=True):
        full = f"{arch}.{name}"
        if full in g.metadata:
            return g.metadata[full]
        if required and default is None:
            raise GGUFError(f"{g.path}: metadata key {full!r} is missing; the file is incomplete")
        return default

    n_embd = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", n_embd // n_head, required=False))
    scaling = key("rope.scaling.type", "none", required=False)
    if scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{g.path}: rope scaling {scaling!r} is not supported (supported: none, linear, yarn)")
    factor = float(key("rope.scaling.factor", 1.0, required=False)) if scaling != "none" else 1.0
    yarn = (int(key("rope.scaling.original_context_length", 0, required=False) or 0),
            float(key("rope.scaling.yarn_beta_fast", 32.0, required=False)),
            float(key("rope.scaling.yarn_beta_slow", 1.0, required=False)),
            float(key("rope.scaling.attn_factor", 1.0, required=False))) if scaling == "yarn" else ()
    n_vocab = key("vocab_size", None, required=False)
    if n_vocab is None:
        n_vocab = len(g.metadata.get("tokenizer.ggml.tokens", [])) or g.tensor("token_embd.weight").shape[0]
    n_expert = int(key("expert_count", 0, required=False))
    return ModelConfig(
        arch=arch,
        name=str(g.metadata.get("general.name", g.path.stem)),
        n_layer=int(key("block_count")),
        n_embd=n_embd,
        n_ff=int(key("feed_forward_length", 0, required=False)),
        n_head=n_head,
        n_head_kv=int(key("attention.head_count_kv", n_head, required=False)),
        head_dim=head_dim,
        n_ctx_train=int(key("context_length", 2048, required=False)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
        rope_base=float(key("rope.freq_base", 10000.0, required=False)),
        rope_dim=int(key("rope.dimension_count", head_dim, required=False)),
        rope_style=fam.rope,
        rope_scale=factor,
        n_vocab=int(n_vocab),
        n_expert=n_expert,
        n_expert_used=int(key("expert_used_count", 0, required=False)),
        n_ff_expert=int(key("expert_feed_forward_length", 0, required=False)),
        n_ff_shared=int(key("expert_shared_feed_forward_length", 0, required=False)),
        expert_weights_norm=bool(key("expert_weights_norm", fam.norm_topk, required=False)),
        extra=tuple(sorted(fam.hparams(key).items())),
        rope_scaling=scaling,
        yarn=yarn,
        n_ctx_orig=int(key("rope.scaling.original_context_length", 0, required=False) or 0),
        rope_attn_factor=float(key("rope.scaling.attn_factor", 1.0, required=False)),
    )
