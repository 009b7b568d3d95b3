"""Typed model configuration read from GGUF metadata (`<arch>.*` keys).

A file may be hostile: each value is checked as it is read (its type, a sane range), against
the others (head counts that divide, a vocabulary the embedding agrees with) and against the
tensors present (block_count is the layers the file holds, so no loop over layers is longer
than the tensor table); `check_tensors` then holds every tensor to the shape its family computes
with. Every refusal is a GGUFError naming the key or tensor and the value."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .arch import UnknownArchitecture, family, supported
from .arch.base import MAX_CONTEXT, MAX_WIDTH
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
    pooling: str = ""               # pooling_type for embeddings ("" when the file names none)

    def get(self, name: str, default=None):
        return dict(self.extra).get(name, default)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


POOLINGS = ("none", "mean", "cls", "last", "rank")        # llama.cpp's pooling_type values 0..4
POSITIVE = 1e-30                 # the lower bound of a float that must be > 0
_LAYER = re.compile(r"blk\.(\d+)\.")


class Keys:
    """The metadata of one architecture (`<arch>.<name>`), each value checked as it is read:
    key(name, default, required, kind=int|float|bool, lo=, hi=) is the value as `kind` in
    [lo, hi], or a GGUFError naming the key and the value (what a hostile or corrupt file gets)."""

    def __init__(self, g: GGUFFile, arch: str):
        self.g, self.arch = g, arch

    def __call__(self, name: str, default=None, required: bool = True, kind=None, lo=None, hi=None):
        full = f"{self.arch}.{name}"
        if full not in self.g.metadata:
            if required and default is None:
                raise GGUFError(f"{self.g.path}: metadata key {full!r} is missing; the file is incomplete")
            return default
        value = self.g.metadata[full]
        if kind is None:
            return value
        if kind is bool:
            if not isinstance(value, (bool, int, np.integer)):
                self.fail(name, value, "must be true or false")
            return bool(value)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not math.isfinite(value) or (kind is int and value != int(value)):
            self.fail(name, value, f"must be {'an integer' if kind is int else 'a finite number'}")
        value = kind(value)
        if lo == POSITIVE and value <= 0:
            self.fail(name, value, "must be greater than 0")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            self.fail(name, value, f"must be in {lo}..{hi}" if lo is not None and hi is not None else
                      f"must be at least {lo}" if lo is not None else f"must be at most {hi}")
        return value

    def fail(self, name: str, value, problem: str):
        shown = repr(value if not isinstance(value, np.ndarray) else value.tolist())
        raise GGUFError(f"{self.g.path}: metadata key {self.arch}.{name} = {shown[:80]}: {problem}; the file is "
                        f"corrupt (re-download it) or not a model Kiln can run")


def read_config(g: GGUFFile) -> ModelConfig:
    arch = g.architecture
    try:
        fam = family(arch)
    except UnknownArchitecture:
        raise GGUFError(f"{g.path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(supported())})") from None
    key = Keys(g, arch)
    n_layer = key("block_count", kind=int, lo=1)
    check_layer_count(key, n_layer)              # bounds it by the tensor table
    n_embd = key("embedding_length", kind=int, lo=1, hi=MAX_WIDTH)
    n_head = key("attention.head_count", kind=int, lo=1, hi=MAX_WIDTH)
    kv_layers = _kv_heads_per_layer(key, fam, n_layer, n_head)
    n_head_kv = max(kv_layers) if kv_layers else \
        key("attention.head_count_kv", n_head, required=False, kind=int, lo=1, hi=n_head)
    if n_head % n_head_kv:
        key.fail("attention.head_count_kv", n_head_kv, f"must divide head_count, {n_head}")
    if f"{arch}.attention.key_length" not in g.metadata and n_embd % n_head:
        key.fail("attention.head_count", n_head, f"must divide embedding_length, {n_embd} (no key_length)")
    # the attention kernels hold a head's row on the stack (csrc/kiln.h MAX_HEAD_DIM): 1,024 values,
    # beyond DeepSeek's 576-value latent rows, the widest any family has
    head_dim = key("attention.key_length", n_embd // n_head, required=False, kind=int, lo=1, hi=1024)
    rope_dim = key("rope.dimension_count", head_dim, required=False, kind=int, lo=2, hi=head_dim)
    if rope_dim % 2:
        key.fail("rope.dimension_count", rope_dim, "must be even (dimensions rotate in pairs)")
    n_ctx_train = key("context_length", 2048, required=False, kind=int, lo=1, hi=MAX_CONTEXT)
    scaling = key("rope.scaling.type", "none", required=False)
    if not isinstance(scaling, str) or scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{g.path}: rope scaling {scaling!r} is not supported (supported: none, linear, yarn)")
    n_ctx_orig = key("rope.scaling.original_context_length", 0, required=False, kind=int, lo=0, hi=MAX_CONTEXT)
    attn_factor = key("rope.scaling.attn_factor", 1.0, required=False, kind=float, lo=POSITIVE, hi=1e6)
    factor = key("rope.scaling.factor", 1.0, required=False, kind=float, lo=POSITIVE, hi=1e6) \
        if scaling != "none" else 1.0
    yarn = (n_ctx_orig,
            key("rope.scaling.yarn_beta_fast", 32.0, required=False, kind=float, lo=-1e6, hi=1e6),
            key("rope.scaling.yarn_beta_slow", 1.0, required=False, kind=float, lo=-1e6, hi=1e6),
            attn_factor) if scaling == "yarn" else ()
    n_expert = key("expert_count", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH)
    n_expert_used = key("expert_used_count", 0, required=False, kind=int, lo=1 if n_expert else 0,
                        hi=n_expert or MAX_WIDTH)
    c = ModelConfig(
        arch=arch,
        name=str(g.metadata.get("general.name", g.path.stem)),
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=key("feed_forward_length", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ctx_train=n_ctx_train,
        rms_eps=key("attention.layer_norm_rms_epsilon", 1e-5, required=False, kind=float, lo=0.0, hi=1.0),
        rope_base=key("rope.freq_base", 10000.0, required=False, kind=float, lo=1.0, hi=1e15),
        rope_dim=rope_dim,
        rope_style=fam.rope,
        rope_scale=factor,
        n_vocab=vocab_size(key, n_embd),
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_expert=key("expert_feed_forward_length", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
        n_ff_shared=key("expert_shared_feed_forward_length", 0, required=False, kind=int, lo=0, hi=MAX_WIDTH),
        expert_weights_norm=key("expert_weights_norm", fam.norm_topk, required=False, kind=bool),
        extra=tuple(sorted((fam.hparams(key) | ({"kv_heads": kv_layers} if kv_layers else {})).items())),
        rope_scaling=scaling,
        yarn=yarn,
        n_ctx_orig=n_ctx_orig,
        rope_attn_factor=attn_factor,
        pooling=POOLINGS[key("pooling_type", 0, required=False, kind=int, lo=0, hi=4)]
        if f"{arch}.pooling_type" in g.metadata else "",
    )
    fam.check(c, key)
    return c


def _kv_heads_per_layer(key: Keys, fam, n_layer: int, n_head: int) -> tuple:
    """head_count_kv given per layer (LFM2: 0 marks a convolution layer): as a tuple, checked —
    one count for every attention layer, a family that reads per-layer counts — or () for one count."""
    value = key.g.metadata.get(f"{key.arch}.attention.head_count_kv")
    if not isinstance(value, (list, tuple, np.ndarray)):
        return ()
    if not getattr(fam, "kv_heads_per_layer", False):
        key.fail("attention.head_count_kv", value, f"a {fam.name} model has one key-head count, not one per layer")
    counts = [int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else -1 for v in value]
    if len(counts) != n_layer or any(not 0 <= v <= n_head for v in counts):
        key.fail("attention.head_count_kv", value, f"must be {n_layer} counts in 0..{n_head}, one per layer")
    if len({v for v in counts if v}) != 1:
        key.fail("attention.head_count_kv", value, "the attention layers must share one key-head count, and there "
                                                   "must be one")
    return tuple(counts)


def check_layer_count(key: Keys, n_layer: int) -> None:
    """block_count must be the layers the file holds (blk.0 … blk.N-1): every loop over layers
    is then bounded by the tensor table, itself bounded by the file's size."""
    present = {int(m.group(1)) for n in key.g.tensors if (m := _LAYER.match(n))}
    if len(present) != n_layer or present != set(range(n_layer)):      # the count first: never a huge range
        held = f"layers {min(present)}..{max(present)} ({len(present)} of them)" if present else "no layers"
        key.fail("block_count", n_layer, f"the file holds {held}")


def vocab_size(key: Keys, n_embd: int) -> int:
    """The vocabulary: the token list's length, `vocab_size` and the embedding's rows must agree
    (token ids index all three)."""
    g = key.g
    rows, *cols = g.tensor("token_embd.weight").shape
    if cols != [n_embd]:
        raise GGUFError(f"{g.path}: tensor 'token_embd.weight' has shape {[rows, *cols]}, expected "
                        f"[n_vocab, {n_embd}] (embedding_length); the file is corrupt")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise GGUFError(f"{g.path}: metadata key 'tokenizer.ggml.tokens' is a {type(tokens).__name__}, "
                        f"not a list of strings; the file is corrupt")
    if tokens and len(tokens) != rows:
        raise GGUFError(f"{g.path}: metadata key 'tokenizer.ggml.tokens' has {len(tokens)} tokens but tensor "
                        f"'token_embd.weight' {rows} rows; the file is corrupt")
    n_vocab = key("vocab_size", rows, required=False, kind=int, lo=1, hi=MAX_CONTEXT)
    if n_vocab != rows:
        key.fail("vocab_size", n_vocab, f"tensor 'token_embd.weight' has {rows} rows")
    return n_vocab


def check_tensors(g: GGUFFile, c: ModelConfig) -> None:
    """Every tensor the model computes with is present and has the shape its family computes
    with — found at load, not as a kernel's error at the first forward."""
    fam = family(c.arch)
    want = {"token_embd.weight": (c.n_vocab, c.n_embd), fam.output_norm: (c.n_embd,)}
    if "output.weight" in g.tensors:
        want["output.weight"] = (c.n_vocab, c.n_embd)
    want |= {n: (c.rope_dim // 2,) for n in fam.model_tensors(g).values()}      # a factor per rotated pair

    def stored(name: str, axis: int) -> int:
        shape = g.tensor(name).shape
        return shape[axis] if axis < len(shape) else 0

    for i in range(c.n_layer):
        want |= fam.shapes(c, i, stored)
    for name, shape in want.items():
        have = g.tensor(name).shape                  # a missing tensor: named
        if shape is not None and have != shape:
            raise GGUFError(f"{g.path}: tensor {name!r} has shape {list(have)}, expected {list(shape)} for "
                            f"this {c.arch} model (embedding {c.n_embd}, {c.n_head} heads and {c.n_head_kv} "
                            f"KV heads of {c.head_dim}, vocabulary {c.n_vocab}); the file is corrupt or a variant "
                            f"of {c.arch} Kiln cannot run")
