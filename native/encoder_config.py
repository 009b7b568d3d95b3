"""What an encoder file is (native/encoder.py runs it): its hyperparameters, each checked as it is
read, and the shape of every tensor its family computes with — llama.cpp's load_arch_hparams and
load_arch_tensors for bert, nomic-bert, jina-bert-v2 and modern-bert."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arch.base import MAX_CONTEXT, MAX_WIDTH
from .config import POOLINGS, Keys, check_layer_count, vocab_size
from .gguf_file import GGUFFile

F32 = np.float32
ENCODER_ARCHS = ("bert", "nomic-bert", "jina-bert-v2", "modern-bert")
ALIBI_MAX_BIAS = 8.0             # jina-bert-v2's, fixed by llama.cpp (not read from the file)


def is_encoder(arch: str) -> bool:
    return arch in ENCODER_ARCHS


@dataclass(frozen=True)
class EncoderConfig:
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_ff: int
    n_ctx_train: int
    eps: float
    n_vocab: int
    pooling: str
    n_cls_out: int
    labels: tuple = ()
    rope_base: float = 0.0          # rotary positions' base (nomic-bert, modern-bert; 0: none)
    n_swa: int = 0                  # modern-bert: its local layers' window (symmetric: n_swa/2 each side)
    swa_pattern: int = 0            # modern-bert: every layer but each swa_pattern-th is local
    rope_base_swa: float = 0.0      # modern-bert: the local layers' rope base
    pooling_cls: str = "cls"        # modern-bert's rank head reads the mean (its default) or the first token

    @property
    def nomic(self) -> bool:
        return self.arch == "nomic-bert"

    @property
    def modern(self) -> bool:
        return self.arch == "modern-bert"

    def local(self, i: int) -> bool:
        """modern-bert's sliding-window layers: all but every swa_pattern-th (the first dense)."""
        return self.n_swa > 0 and (self.swa_pattern == 0 or i % self.swa_pattern != 0)

    @property
    def alibi(self) -> bool:
        return self.arch == "jina-bert-v2"

    @property
    def learned_positions(self) -> bool:
        return self.arch == "bert"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def read_encoder_config(g: GGUFFile) -> EncoderConfig:
    arch = g.architecture
    key = Keys(g, arch)
    n_layer = key("block_count", kind=int, lo=1)
    check_layer_count(key, n_layer)
    n_embd = key("embedding_length", kind=int, lo=1, hi=MAX_WIDTH)
    n_head = key("attention.head_count", kind=int, lo=1, hi=MAX_WIDTH)
    if n_embd % n_head:
        key.fail("attention.head_count", n_head, f"must divide embedding_length, {n_embd}")
    kv = key("attention.head_count_kv", n_head, required=False, kind=int, lo=1, hi=n_head)
    if kv != n_head:
        key.fail("attention.head_count_kv", kv, f"an encoder's key heads are its query heads ({n_head})")
    if key("attention.causal", False, required=False, kind=bool):
        key.fail("attention.causal", True, "a BERT encoder attends both ways")
    pooling = key("pooling_type", 1, required=False, kind=int, lo=0, hi=len(POOLINGS) - 1)
    labels = g.metadata.get(f"{arch}.classifier.output_labels") or []
    if not isinstance(labels, list) or not all(isinstance(s, str) for s in labels):
        key.fail("classifier.output_labels", labels, "must be an array of strings")
    return EncoderConfig(
        arch=arch, name=str(g.metadata.get("general.name", g.path.stem)), n_layer=n_layer, n_embd=n_embd,
        n_head=n_head, n_ff=key("feed_forward_length", kind=int, lo=1, hi=MAX_WIDTH),
        n_ctx_train=key("context_length", kind=int, lo=1, hi=MAX_CONTEXT),
        eps=key("attention.layer_norm_epsilon", 1e-12, required=False, kind=float, lo=0.0, hi=1.0),
        n_vocab=vocab_size(key, n_embd), pooling=POOLINGS[pooling], n_cls_out=max(1, len(labels)),
        labels=tuple(labels),
        **_rotary(key, arch))


def _rotary(key: Keys, arch: str) -> dict:
    if arch not in ("nomic-bert", "modern-bert"):
        return {}
    base = key("rope.freq_base", 10000.0, required=False, kind=float, lo=1.0, hi=1e15)
    if arch == "nomic-bert":
        return {"rope_base": base}
    n_swa = key("attention.sliding_window", 0, required=False, kind=int, lo=0, hi=MAX_CONTEXT)
    pooling_cls = key("classifier.pooling_type", 1, required=False, kind=int, lo=1, hi=2)   # mean or cls
    return {"rope_base": base, "n_swa": n_swa, "pooling_cls": POOLINGS[pooling_cls],
            "swa_pattern": key("attention.sliding_window_pattern", 3, required=False, kind=int, lo=0, hi=MAX_WIDTH),
            "rope_base_swa": key("rope.freq_base_swa", base, required=False, kind=float, lo=1.0, hi=1e15)}


def tensor_plan(g: GGUFFile, c: EncoderConfig) -> tuple[dict, list]:
    """The shape of every tensor this encoder computes with, and which are matrices: llama.cpp's
    create_tensor_qkv (a fused q|k|v or three), optional biases where it allows them."""
    d, f = c.n_embd, c.n_ff
    if c.modern:
        return _modern_plan(g, c)
    want = {"token_embd.weight": (c.n_vocab, d), "token_embd_norm.weight": (d,), "token_embd_norm.bias": (d,)}
    if c.learned_positions:
        want["position_embd.weight"] = (c.n_ctx_train, d)
    if "token_types.weight" in g.tensors:
        want["token_types.weight"] = (g.tensor("token_types.weight").shape[0] or 1, d)
    mats = []
    fused = "blk.0.attn_qkv.weight" in g.tensors
    for i in range(c.n_layer):
        p = f"blk.{i}."
        proj = {"attn_output": (d, d), "ffn_up": (f, d), "ffn_down": (d, f)}
        proj |= {"attn_qkv": (3 * d, d)} if fused else {"attn_q": (d, d), "attn_k": (d, d), "attn_v": (d, d)}
        if c.nomic or (c.alibi and p + "ffn_gate.weight" in g.tensors):
            proj["ffn_gate"] = (f, d)
        if c.alibi and "ffn_gate" not in proj:            # jina's up holds the gate: 2 × FFN rows
            proj["ffn_up"] = (2 * f, d)
        for t, shape in proj.items():
            want[p + t + ".weight"] = shape
            mats.append(p + t + ".weight")
            has_bias = t not in ("ffn_up", "ffn_down", "ffn_gate") or not c.nomic       # nomic's FFN: none
            has_bias &= t != "ffn_gate"                                                # a gate: never
            if has_bias and p + t + ".bias" in g.tensors:
                want[p + t + ".bias"] = (shape[0],)
        if fused and p + "attn_qkv.bias" not in g.tensors:
            want |= {p + t + ".bias": (d,) for t in ("attn_q", "attn_k", "attn_v") if p + t + ".bias" in g.tensors}
        for t in ("attn_output_norm", "layer_output_norm"):
            want |= {p + t + ".weight": (d,), p + t + ".bias": (d,)}
        for t in ("attn_q_norm", "attn_k_norm", "attn_norm_2"):      # jina's, where the file has them
            if c.alibi and p + t + ".weight" in g.tensors:
                want |= {p + t + ".weight": (d,), p + t + ".bias": (d,)}
    return want, mats


def _modern_plan(g: GGUFFile, c: EncoderConfig) -> tuple[dict, list]:
    """modern-bert: pre-norm LayerNorms without biases (layer 0's attention norm optional), a fused
    q|k|v, a GELU-gated up (2 × FFN rows), no biases anywhere, a final norm."""
    d, f = c.n_embd, c.n_ff
    want = {"token_embd.weight": (c.n_vocab, d), "token_embd_norm.weight": (d,), "output_norm.weight": (d,)}
    mats = []
    for i in range(c.n_layer):
        p = f"blk.{i}."
        for t, shape in (("attn_qkv", (3 * d, d)), ("attn_output", (d, d)), ("ffn_up", (2 * f, d)),
                         ("ffn_down", (d, f))):
            want[p + t + ".weight"] = shape
            mats.append(p + t + ".weight")
        want[p + "ffn_norm.weight"] = (d,)
        if i or p + "attn_norm.weight" in g.tensors:
            want[p + "attn_norm.weight"] = (d,)
    return want, mats


def alibi_slopes(n_head: int, max_bias: float = ALIBI_MAX_BIAS) -> np.ndarray:
    """Each head's ALiBi slope as ggml_soft_max_ext makes it (powf of the C library)."""
    from .blocks import _libm
    lib = _libm()
    powf = lib.powf if lib is not None else (lambda a, b: float(np.float32(a) ** np.float32(b)))
    log2 = 1 << int(np.floor(np.log2(np.float32(n_head))))
    m0 = powf(2.0, float(F32(-max_bias) / F32(log2)))
    m1 = powf(2.0, float(F32(-(max_bias / 2.0)) / F32(log2)))
    return np.array([powf(m0, h + 1) if h < log2 else powf(m1, 2 * (h - log2) + 1) for h in range(n_head)], F32)


