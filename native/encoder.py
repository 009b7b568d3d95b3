"""Encoder models — embedders and rerankers of the BERT family — as llama.cpp runs them
(src/models/bert.cpp, llm_graph_context::build_pooling).

    x = LayerNorm(token_embd[t] + token_types[0] + position_embd[p])
    per layer:  x = LayerNorm(x + attn(x));  x = LayerNorm(x + down(gelu(up(x))))

nomic-bert (nomic-embed-text) is the same skeleton with rotary positions (neox) in place of the
position table, a fused q|k|v, and a SwiGLU FFN without biases; jina-bert-v2 (jina-embeddings-v2)
has ALiBi (each head's slope times -|i - j| added to its scores, max bias 8), optional LayerNorms
on the queries and keys, and a GELU-gated FFN (llama.cpp runs the three through one graph).
    pooled by the file's pooling type: none, mean, cls (first), last, or rank (the classifier
    head on the first token: cls_out(tanh(cls x)))

Attention is bidirectional within each input; several inputs run as one forward — their rows
stacked, every matrix product reads the weights once for all of them, attention kept inside
each input — so a batch of 32 costs far less than 32 calls. There is no KV cache and no
generation: an encoder answers embeddings and ranks only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from . import ggml_round, kernels
from .config import POOLINGS
from .encoder_config import ENCODER_ARCHS, EncoderConfig, alibi_slopes, is_encoder, read_encoder_config, tensor_plan
from .gguf_file import GGUFError, read_gguf
from .blocks import apply_rope, rope_tables, swiglu_ffn
from .kernels import matmul, matmul_many
from .tokenizer import GGUFTokenizer

__all__ = ["ENCODER_ARCHS", "MAX_BATCH_TOKENS", "Encoder", "EncoderConfig", "is_encoder", "load_encoder",
           "read_encoder_config"]

F32 = np.float32
MAX_BATCH_TOKENS = 8192          # rows of one forward: an activation bound, not a request's


class Encoder:
    """A loaded encoder: `config`, `tokenizer`, `embed(inputs)`, `rank(inputs)`."""

    kind = "encoder"

    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, weights: str = "mapped"):
        """`weights`: "mapped" (the file's page cache) or "private" (copied into huge pages, as a
        decoder's: native/private_weights.py)."""
        t0 = time.perf_counter()
        self.path = Path(path)
        self.gguf = g = read_gguf(self.path)
        self.config = c = read_encoder_config(g)
        if weights not in ("mapped", "private"):
            raise ValueError(f"weights = {weights!r}: must be mapped or private")
        if weights == "private":
            g.copy_to_private(list(g.tensors))
        self.tokenizer = GGUFTokenizer(g)
        want, mats = tensor_plan(g, c)
        if c.pooling == "rank":
            d = c.n_embd
            if "cls.weight" in g.tensors:        # (n_embd, n_embd); jina's rerankers: (1, n_embd), no cls.output
                rows = g.tensor("cls.weight").shape[0] if c.alibi else d
                want |= {"cls.weight": (rows, d)} | ({"cls.bias": (rows,)} if "cls.bias" in g.tensors else {})
                if c.modern and "cls.norm.weight" in g.tensors:        # modern-bert's head norm (no bias)
                    want["cls.norm.weight"] = (rows,)
            if "cls.output.weight" in g.tensors:
                want |= {"cls.output.weight": (c.n_cls_out, d)}
                if "cls.output.bias" in g.tensors:
                    want["cls.output.bias"] = (c.n_cls_out,)
            if "cls.weight" not in want and "cls.output.weight" not in want:
                raise GGUFError(f"{self.path}: pooling type rank needs a classification head (tensors cls.weight "
                                f"or cls.output.weight) and the file has none; it is not a reranker")
        for name, shape in want.items():
            have = g.tensor(name).shape                     # a missing tensor: named
            if have != shape:
                raise GGUFError(f"{self.path}: tensor {name!r} has shape {list(have)}, expected {list(shape)} for "
                                f"this {c.arch} encoder (embedding {c.n_embd}, FFN {c.n_ff}, {c.n_ctx_train} positions, "
                                f"vocabulary {c.n_vocab}); the file is corrupt")
        self.w = kernels.load_weights(g, ["token_embd.weight", *mats], threads or min(4, os.cpu_count() or 1))
        self.fused_qkv = "blk.0.attn_qkv.weight" in self.w
        self.slopes = alibi_slopes(c.n_head) if c.alibi else None
        self._zeros = np.zeros(c.n_embd, F32)            # a LayerNorm without a bias (modern-bert)
        self.v = {n: kernels.load_vector(g, n) for n in want if n not in self.w}
        # the rank head's matrices: F32 ones in ggml's one-row order (numpy), the others as weights
        self.head = {n: None if g.tensor(n + ".weight").type == 0 else kernels.load_weights(g, [n + ".weight"])[n + ".weight"]
                     for n in ("cls", "cls.output") if n + ".weight" in want}
        self.load_seconds = time.perf_counter() - t0

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.w.values()) + sum(a.nbytes for a in self.v.values())

    def _bias(self, x: np.ndarray, name: str) -> np.ndarray:
        """x plus the bias `name` if the file has one (in place: x is a product's fresh output)."""
        b = self.v.get(name)
        if b is not None:
            x += b
        return x

    def _project(self, x: np.ndarray, name: str) -> np.ndarray:
        return self._bias(matmul(x, self.w[name + ".weight"]), name + ".bias")

    def hidden(self, inputs: list[list[int]]) -> list[np.ndarray]:
        """The last layer's states (n_i, n_embd) of each input, all inputs in one forward."""
        c = self.config
        for ids in inputs:
            if not ids or len(ids) > c.n_ctx_train or not all(0 <= t < c.n_vocab for t in ids):
                raise ValueError(f"an input must have 1..{c.n_ctx_train} token ids in 0..{c.n_vocab - 1}")
        bounds = np.cumsum([0] + [len(ids) for ids in inputs])
        tokens = np.fromiter((t for ids in inputs for t in ids), np.int64, int(bounds[-1]))
        positions = np.concatenate([np.arange(len(ids)) for ids in inputs])
        if c.modern:
            x = self._modern(tokens, positions, bounds)
            return [x[s:e] for s, e in zip(bounds[:-1], bounds[1:])]
        x = self.w["token_embd.weight"].rows(tokens)
        if "token_types.weight" in self.v:              # llama.cpp feeds type 0 ("sentence A") only
            x = x + self.v["token_types.weight"][0]
        if c.learned_positions:
            x = self.v["position_embd.weight"][positions] + x
        x = kernels.layer_norm(x, self.v["token_embd_norm.weight"], self.v["token_embd_norm.bias"], c.eps)
        rope = rope_tables(positions, c.head_dim, c.rope_base, 1.0) if c.nomic else None
        for i in range(c.n_layer):
            p = f"blk.{i}."
            q, k, v = self._qkv(x, p, rope)
            a = np.empty_like(q)
            for s, e in zip(bounds[:-1], bounds[1:]):
                a[s:e] = self._attend(q[s:e], k[s:e], v[s:e])
            a = self._project(a, p + "attn_output")
            h = kernels.layer_norm(a + x, self.v[p + "attn_output_norm.weight"], self.v[p + "attn_output_norm.bias"], c.eps)
            if p + "attn_norm_2.weight" in self.v:       # the layer's input added again, normed again
                h = kernels.layer_norm(h + x, self.v[p + "attn_norm_2.weight"], self.v[p + "attn_norm_2.bias"], c.eps)
            x = h
            if c.nomic:                                   # nomic: SwiGLU, no biases (llama.cpp passes none)
                h = swiglu_ffn(x, self.w[p + "ffn_gate.weight"], self.w[p + "ffn_up.weight"], self.w[p + "ffn_down.weight"])
            elif c.alibi:                                 # jina: GELU-gated, the gate fused into up or its own
                up = self._project(x, p + "ffn_up")
                gate, up = (up[:, :c.n_ff], up[:, c.n_ff:]) if p + "ffn_gate.weight" not in self.w else \
                    (matmul(x, self.w[p + "ffn_gate.weight"]), up)
                h = self._project(kernels.geglu(np.ascontiguousarray(gate), np.ascontiguousarray(up)), p + "ffn_down")
            else:
                h = self._project(kernels.gelu(self._project(x, p + "ffn_up")), p + "ffn_down")
            x = kernels.layer_norm(h + x, self.v[p + "layer_output_norm.weight"], self.v[p + "layer_output_norm.bias"],
                                   c.eps)
        return [x[s:e] for s, e in zip(bounds[:-1], bounds[1:])]

    def _modern(self, tokens: np.ndarray, positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """modern-bert's pre-norm stack (src/models/modern-bert.cpp): LayerNorms without biases,
        rotary positions with the local layers' own base, local layers attending within a
        symmetric window, GELU-gated FFN, a final norm."""
        c, v = self.config, self.v
        norm = lambda x, name: kernels.layer_norm(x, v[name], self._zeros, c.eps)     # noqa: E731
        x = norm(self.w["token_embd.weight"].rows(tokens), "token_embd_norm.weight")
        tables = {}
        for i in range(c.n_layer):
            p, local = f"blk.{i}.", c.local(i)
            base = c.rope_base_swa if local else c.rope_base
            if base not in tables:
                tables[base] = rope_tables(positions, c.head_dim, base, 1.0)
            h = norm(x, p + "attn_norm.weight") if p + "attn_norm.weight" in v else x
            q, k, vv = self._qkv(h, p, tables[base])
            a = np.empty_like(q)
            for s, e in zip(bounds[:-1], bounds[1:]):
                a[s:e] = self._attend(q[s:e], k[s:e], vv[s:e], c.n_swa // 2 if local else 0)
            x = matmul(a, self.w[p + "attn_output.weight"]) + x
            up = matmul(norm(x, p + "ffn_norm.weight"), self.w[p + "ffn_up.weight"])
            g = kernels.geglu(np.ascontiguousarray(up[:, :c.n_ff]), np.ascontiguousarray(up[:, c.n_ff:]))
            x = matmul(g, self.w[p + "ffn_down.weight"]) + x
        return norm(x, "output_norm.weight")

    def _qkv(self, x: np.ndarray, p: str, rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries, keys and values of layer p: from a fused q|k|v (plus its bias, or the three
        biases of a legacy file) or three products; rotated when the model has rotary positions."""
        d = self.config.n_embd
        if self.fused_qkv:
            y = self._bias(matmul(x, self.w[p + "attn_qkv.weight"]), p + "attn_qkv.bias")
            q, k, v = (np.ascontiguousarray(y[:, j * d:(j + 1) * d]) for j in range(3))
            if p + "attn_qkv.bias" not in self.v:
                q, k, v = (self._bias(m, p + t + ".bias") for m, t in zip((q, k, v), ("attn_q", "attn_k", "attn_v")))
        else:
            q, k, v = (self._bias(y, p + t + ".bias") for y, t in zip(
                matmul_many(x, [self.w[p + t + ".weight"] for t in ("attn_q", "attn_k", "attn_v")]),
                ("attn_q", "attn_k", "attn_v")))
        if rope is not None:
            H, hd = self.config.n_head, self.config.head_dim
            for m in (q, k):
                apply_rope(m.reshape(len(m), H, hd), *rope, "neox")
        if p + "attn_q_norm.weight" in self.v:            # jina: LayerNorm over all heads' queries, keys
            eps = self.config.eps
            q = kernels.layer_norm(q, self.v[p + "attn_q_norm.weight"], self.v[p + "attn_q_norm.bias"], eps)
            k = kernels.layer_norm(k, self.v[p + "attn_k_norm.weight"], self.v[p + "attn_k_norm.bias"], eps)
        return q, k, v

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0) -> np.ndarray:
        """Attention within one input: in C as llama.cpp computes it (its bits), else in numpy.
        `window` > 0: each position sees only those within `window` of it (modern-bert's local layers)."""
        c = self.config
        n, H, d = len(q), c.n_head, c.head_dim
        out = kernels.encoder_attention(q, k, v, H, F32(1) / np.sqrt(F32(d)), self.slopes, window)   # 1.0f/sqrtf
        if out is not None:
            return out
        qh, kh, vh = (m.reshape(n, H, d).transpose(1, 0, 2) for m in (q, k, v))
        out = np.empty((n, H * d), F32)
        pos = np.arange(n)
        step = max(1, (1 << 22) // max(1, H * n))          # query rows a block: scores bounded to 16 MiB
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            s = np.matmul(qh[:, r0:r1], kh.transpose(0, 2, 1)) * F32(1.0 / np.sqrt(d))
            dist = np.abs(pos[r0:r1, None] - pos[None, :])
            if self.slopes is not None:
                s += self.slopes[:, None, None] * -dist.astype(F32)
            if window:
                s[:, dist > window] = -np.inf
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s *= F32(1) / s.sum(axis=-1, keepdims=True)
            out[r0:r1] = np.matmul(s, vh).transpose(1, 0, 2).reshape(r1 - r0, H * d)
        return out

    def pooled(self, inputs: list[list[int]], pooling: str | None = None) -> list[np.ndarray]:
        """Each input pooled by `pooling` (default the file's): (n_embd,), or (n_i, n_embd) for
        none, or (n_cls_out,) for rank. Inputs run in forwards of at most MAX_BATCH_TOKENS rows."""
        pooling = pooling or self.config.pooling
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r}: one of {', '.join(POOLINGS)}")
        if pooling == "rank" and self.config.pooling != "rank":
            raise ValueError(f"{self.path.name} has no classification head: it embeds, it does not rank")
        out: list[np.ndarray] = []
        for group in _groups(inputs, MAX_BATCH_TOKENS):
            for h in self.hidden(group):
                out.append(self._pool(h, pooling))
        return out

    def _pool(self, h: np.ndarray, pooling: str) -> np.ndarray:
        if pooling == "none":
            return h
        if pooling == "mean":
            return (h.astype(np.float64).sum(axis=0) / len(h)).astype(F32)
        if pooling == "last":
            return h[-1]
        c = self.config
        x = self._pool(h, "mean") if pooling == "rank" and c.modern and c.pooling_cls == "mean" else h[0]
        if pooling == "cls":
            return x
        if "cls.weight" in self.v:                   # one row: ggml_vec_dot_f32; tanhf (modern-bert: GELU)
            y = self._head(x, "cls")
            x = kernels.gelu(y) if c.modern else ggml_round.libm_tanhf(y)
            if "cls.norm.weight" in self.v:
                x = kernels.layer_norm(x[None], self.v["cls.norm.weight"], np.zeros_like(x), c.eps)[0]
        if "cls.output.weight" in self.v:
            x = self._head(x, "cls.output")
        return x

    def _head(self, x: np.ndarray, name: str) -> np.ndarray:
        """The classification head's product for one row, as ggml multiplies it: F32 weights by
        ggml_vec_dot_f32; others by the kernels (a one-row product, as llama.cpp's)."""
        w = self.head[name]
        y = ggml_round.vec_dot_f32(self.v[name + ".weight"], x) if w is None else matmul(x[None], w)[0]
        return (y + self.v[name + ".bias"]).astype(F32) if name + ".bias" in self.v else y.astype(F32)

    def rank_prompt(self, query: list[int], document: list[int]) -> list[int]:
        """llama-server's rerank input without a rerank template (format_prompt_rerank): BOS,
        the query, EOS if the vocabulary adds one, SEP, the document, EOS."""
        sp, tok = self.tokenizer.special, self.tokenizer
        eos = sp.eos if sp.eos is not None else tok.sep
        ids = [sp.bos] if sp.add_bos and sp.bos is not None else []
        ids += query + ([eos] if sp.add_eos and eos is not None else [])
        ids += [tok.sep] if tok.sep is not None else []
        return ids + document + ([eos] if sp.add_eos and eos is not None else [])


def _groups(inputs: list[list[int]], budget: int):
    group, rows = [], 0
    for ids in inputs:
        if group and rows + len(ids) > budget:
            yield group
            group, rows = [], 0
        group.append(ids)
        rows += len(ids)
    if group:
        yield group


def load_encoder(path: str | os.PathLike, **kw) -> Encoder:
    if kw.get("weights", "mapped") not in ("mapped", "private"):     # the caller's mistake, not the file's
        raise ValueError(f"weights = {kw['weights']!r}: must be mapped or private")
    try:
        return Encoder(path, **kw)
    except (OSError, ValueError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path}: cannot load model: {e}") from e
