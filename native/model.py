"""A loaded model: config, tokenizer, weights, and the forward pass.

What an architecture's layer holds and how it computes is declared by its family in the
registry (native/arch/); this module loads those tensors into `Layer`s, provides the blocks a
family's `layer()` is written in (norm, attention, ffn), and decides how each block runs: a
decode step of a layer in the llama skeleton runs as one compiled call, everything else through
the compiled products or numpy — bit for bit the same either way.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import ggml_round, kernels, streamed_moe
from .arch import family
from .blocks import apply_rope, attention, moe_ffn, rms_norm, rope_tables, route, swiglu_ffn, yarn_params
from .config import ModelConfig, check_tensors, read_config
from .gguf_file import GGUFError, GGUFFile, read_gguf
from .kernels import Weight, matmul, matmul_many
from .kv_cache import KV_DTYPE, KVCache
from .tokenizer import GGUFTokenizer

# the longest run of one sequence's rows a layer computes in one compiled call (a speculative
# draft and the token before it); longer runs (prompts) take the blockwise path
FUSED_RUN = 17


@dataclass
class Ctx:
    """What every block of one forward shares: rope tables, the sequences' caches, the adapter."""
    cos: np.ndarray
    sin: np.ndarray
    segments: list                 # (cache, first row, end row) per sequence
    adapter: object = None
    positions: np.ndarray | None = None
    model: object = None
    residual: np.ndarray | None = None  # the stream an FFN's output is added to (streamed experts read ahead from it)
    _ropes: dict = field(default_factory=dict)

    def rope(self, base: float) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) of these positions for another rope base (gemma3's sliding layers)."""
        if base not in self._ropes:
            c = self.model.config
            self._ropes[base] = rope_tables(self.positions, c.rope_dim, base, c.rope_scale, self.model.rope_factors,
                                            self.model.rope_yarn)
        return self._ropes[base]


@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: Weight | None = None             # None in a recurrent layer (qwen35's delta nets)
    wk: Weight | None = None
    wv: Weight | None = None
    wo: Weight | None = None
    ffn_norm: np.ndarray | None = None
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    qk_norm_per_head: bool = True
    # dense FFN
    gate: Weight | None = None
    up: Weight | None = None
    down: Weight | None = None
    # MoE FFN
    router: Weight | None = None              # (n_expert, n_embd)
    gate_exps: Weight | None = None           # (n_expert, n_ff_expert, n_embd)
    up_exps: Weight | None = None
    down_exps: Weight | None = None
    # shared expert (qwen2moe)
    shared_gate_inp: Weight | None = None      # (1, n_embd)
    shared_gate: np.ndarray | None = None      # the same, as loaded
    post_attn_norm: np.ndarray | None = None   # gemma3: norms of the attention and FFN outputs
    post_ffn_norm: np.ndarray | None = None
    gate_shexp: Weight | None = None
    up_shexp: Weight | None = None
    down_shexp: Weight | None = None
    experts: dict = field(default_factory=dict)   # e -> (gate, up, down) views, made once

    def expert(self, e: int) -> tuple[Weight, Weight, Weight]:
        w = self.experts.get(e)
        if w is None:
            w = self.experts[e] = (self.gate_exps.expert(e), self.up_exps.expert(e), self.down_exps.expert(e))
        return w


WEIGHTS = ("mapped", "private")


def check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights = {weights!r}: must be one of {', '.join(WEIGHTS)}")


class Model:
    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, weights: str = "mapped",
                 keep_mapped=()):
        """`weights`: "mapped" (views of the file's page cache) or "private" (copied into huge
        pages, native/private_weights.py) — all tensors but `keep_mapped` (a streamed model's
        experts, which the expert cache reads)."""
        t0 = time.perf_counter()
        check_weights(weights)
        self.path = Path(path)
        self.gguf: GGUFFile = read_gguf(self.path)
        if weights == "private":
            keep = set(keep_mapped)
            self.gguf.copy_to_private(n for n in self.gguf.tensors if n not in keep)
        self.config: ModelConfig = read_config(self.gguf)
        self.tokenizer = GGUFTokenizer(self.gguf)
        self.expert_provider = None    # an ExpertCache streams experts instead of the mapped file
        self._load(threads or min(4, os.cpu_count() or 1))
        self.load_seconds = time.perf_counter() - t0

    # -- loading ------------------------------------------------------------------------------

    def _load(self, threads: int) -> None:
        g, c = self.gguf, self.config
        fam = self.family = family(c.arch)
        names = ["token_embd.weight"]
        self.tied_output = "output.weight" not in g.tensors
        if not self.tied_output:
            names.append("output.weight")
        plan = [(fam.matrices(c, i), fam.vectors(c, i), fam.fused(c, i)) for i in range(c.n_layer)]
        for mats, vecs, fused in plan:
            names += list(mats.values()) + list(fused)
        check_tensors(g, c)          # fail fast, before any work, on a missing or misshapen tensor (named)
        weights = kernels.load_weights(g, names, threads)
        vec = lambda n: kernels.load_vector(g, n)  # noqa: E731
        self.token_embd = weights["token_embd.weight"]
        self.output = self.token_embd if self.tied_output else weights["output.weight"]
        self.output_norm = vec("output_norm.weight")
        self.attn_scales = fam.attention_scales(c)
        self.embed_scale = fam.embed_scale(c)
        extra = {k: vec(n) for k, n in fam.model_tensors(g).items()}
        self.rope_factors = extra.get("rope_freqs")
        self._rope_long_short = (extra["rope_long"], extra["rope_short"]) if "rope_long" in extra else None
        self.rope_yarn = None
        if c.rope_scaling == "yarn":
            orig, fast, slow, attn = c.yarn
            self.rope_yarn = yarn_params(c.rope_dim, c.rope_base, c.rope_scale, orig or c.n_ctx_train, fast, slow,
                                         1.0, attn)
        elif c.rope_attn_factor != 1.0:
            self.rope_yarn = (0.0, 0.0, 0.0, c.rope_attn_factor)   # no ramp: cos/sin times the factor
        self.use_context(c.n_ctx_train)
        self.layers: list[Layer] = []
        for mats, vecs, fused in plan:
            fields = {k: weights[n] for k, n in mats.items()}
            for n, parts in fused.items():
                start = 0
                for fld, rows in parts:
                    fields[fld] = weights[n].row_slice(f"{n}[{fld}]", start, start + rows)
                    start += rows
                if start != weights[n].shape[0]:
                    raise GGUFError(f"{g.path}: tensor {n!r} has {weights[n].shape[0]} rows, expected {start} "
                                    f"({' + '.join(f'{f} {r}' for f, r in parts)})")
            fields |= {k: vec(n) for k, n in vecs.items()}
            known = Layer.__dataclass_fields__
            L = Layer(**{k: v for k, v in fields.items() if k in known})
            for k, v in fields.items():              # a family's own tensors (ssm_conv, …)
                if k not in known:
                    setattr(L, k, v)
            L.qk_norm_per_head = getattr(fam, "qk_norm", "head") == "head"
            if L.shared_gate is not None:
                v = L.shared_gate.reshape(1, -1)
                L.shared_gate_inp = Weight(vecs["shared_gate"], kernels.Q.F32, v.shape, v.view(np.uint8).reshape(1, -1), v)
            self.layers.append(L)

    @property
    def weight_bytes(self) -> int:
        """Bytes the engine holds for weights (float32 on the reference path)."""
        seen, total = set(), 0
        for w in [self.token_embd, self.output, self.output_norm] + [
                getattr(L, f) for L in self.layers for f in Layer.__dataclass_fields__]:
            if isinstance(w, Weight) and id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
            elif isinstance(w, np.ndarray):
                total += w.nbytes
        return total

    def use_context(self, n_ctx: int) -> None:
        """What depends on the context the model runs with: Phi-3 longrope's factor set — the
        long one past the original context, as llama.cpp chooses by its n_ctx."""
        if self._rope_long_short is not None:
            c = self.config
            long, short = self._rope_long_short
            self.rope_factors = long if n_ctx > (c.n_ctx_orig or c.n_ctx_train) else short

    def new_cache(self, max_tokens: int | None = None, dtype: type = KV_DTYPE) -> KVCache:
        """fp16 keys and values, as llama.cpp keeps them: half the memory and traffic of float32,
        and — with the query and probabilities rounded as ggml rounds them — closer to llama.cpp
        (the E8K2 variant meets its bars only so; float32 misses them, tests/data/README.md)."""
        c = self.config
        windows = {i: c.get("sliding_window") for i in range(c.n_layer) if self.family.sliding(c, i)}
        return KVCache(c.n_layer, c.n_head_kv, c.head_dim, max_tokens or c.n_ctx_train, dtype,
                       self.family.recurrent_state(c), windows)

    # -- forward ------------------------------------------------------------------------------

    def forward(self, tokens: list[int], cache: KVCache, *, all_logits: bool = False,
                logits_from: int | None = None, adapter=None) -> np.ndarray:
        """Run `tokens` (appended after the cache's positions) through the model.

        Returns logits (T, n_vocab) if all_logits, (T - logits_from, n_vocab) for the rows from
        `logits_from` on, else (n_vocab,) for the last token. `adapter`: a LoRA (native/lora.py)
        added to the projections it names; the cache must have been filled with the same one."""
        c = self.config
        if not tokens:
            raise ValueError("forward() needs at least one token")
        bad = [t for t in tokens if not 0 <= t < c.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{c.n_vocab - 1})")
        cache.begin(tokens)
        x = self._layers(np.asarray(tokens), np.arange(cache.n, cache.n + len(tokens)), [(cache, 0, len(tokens))],
                         adapter)
        cache.commit(tokens)
        rows = x if all_logits else x[logits_from:] if logits_from is not None else x[-1:]
        logits = matmul(rms_norm(rows, self.output_norm, c.rms_eps), self.output)
        return logits if (all_logits or logits_from is not None) else logits[0]

    def hidden(self, tokens: list[int], cache: KVCache, adapter=None) -> np.ndarray:
        """The final hidden states (T, n_embd) of `tokens`, after the output norm: what the
        output head would read, and what embeddings pool (llama.cpp's result_norm)."""
        c = self.config
        bad = [t for t in tokens if not 0 <= t < c.n_vocab]
        if not tokens or bad:
            raise ValueError(f"hidden() needs token ids in 0..{c.n_vocab - 1}")
        cache.begin(tokens)
        x = self._layers(np.asarray(tokens), np.arange(cache.n, cache.n + len(tokens)), [(cache, 0, len(tokens))],
                         adapter)
        cache.commit(tokens)
        return rms_norm(x, self.output_norm, c.rms_eps)

    def forward_batch(self, tokens: list[int], caches: list[KVCache], adapter=None) -> np.ndarray:
        """One decode step for several sequences: tokens[i] is appended to caches[i].
        Returns logits (B, n_vocab). The weight matrices are read once for the whole batch;
        on the compiled path each row is bit-identical to a forward() of that sequence alone."""
        return self.forward_runs([([t], cache) for t, cache in zip(tokens, caches)], adapter)

    def forward_runs(self, runs: list[tuple[list[int], KVCache]], adapter=None) -> np.ndarray:
        """Several sequences in one forward, each run's tokens appended to its cache — decode
        steps and a prompt's next chunk together. Returns logits (len(runs), n_vocab) of each
        run's last token, bit-identical to forward() of that run alone (every kernel computes a
        row the same whatever else is in the batch)."""
        c = self.config
        if not runs or any(not toks for toks, _ in runs):
            raise ValueError("forward_runs() needs at least one token in every run")
        bad = [t for toks, _ in runs for t in toks if not 0 <= t < c.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{c.n_vocab - 1})")
        segments, positions, at = [], [], 0
        for toks, cache in runs:
            cache.begin(toks)
            segments.append((cache, at, at + len(toks)))
            positions.append(np.arange(cache.n, cache.n + len(toks)))
            at += len(toks)
        x = self._layers(np.asarray([t for toks, _ in runs for t in toks]), np.concatenate(positions), segments,
                         adapter)
        for toks, cache in runs:
            cache.commit(toks)
        last = x[[b - 1 for _, _, b in segments]]
        return matmul(rms_norm(last, self.output_norm, c.rms_eps), self.output)

    def _layers(self, tokens: np.ndarray, positions: np.ndarray, segments: list, adapter=None) -> np.ndarray:
        """The decoder stack over rows that belong to one or more sequences; `segments` lists
        (cache, first row, end row) for each sequence."""
        c = self.config
        cos, sin = rope_tables(positions, c.rope_dim, c.rope_base, c.rope_scale, self.rope_factors, self.rope_yarn)
        ctx = Ctx(cos, sin, segments, adapter, positions, self)
        x = self.token_embd.rows(tokens)
        if self.embed_scale:
            x *= np.float32(self.embed_scale)
        # a decode step (one row per sequence), or a short run of rows (a speculative draft
        # being checked), runs each layer in one compiled call: a row at position p attends to
        # the rows before it, whose keys the call stores before any row attends
        fuse = self.family.llama_skeleton and len(tokens) <= 64 \
            and all(b - a <= FUSED_RUN for _, a, b in segments) \
            and adapter is None and len({cache.dtype for cache, _, _ in segments}) == 1 \
            and kernels.compiled_module() is not None
        rows = [(cache, cache.n + r) for cache, a, b in segments for r in range(b - a)] if fuse else []
        provider = self.expert_provider
        for i, L in enumerate(self.layers):
            how = self._fusable[i] if fuse else None
            if how == "moe" and provider is not None:
                if not hasattr(provider, "table"):
                    how = "attention"            # a plain provider: the experts fetched in Python
                else:
                    # streamed experts: one compiled call if the chosen experts are resident (the
                    # table of where they are); else it stops after the attention and routing,
                    # and the FFN runs in compiled steps as the experts arrive
                    chosen = np.empty((len(rows), self.config.n_expert_used), np.int32)
                    chosen_w = np.empty(chosen.shape, np.float32)
                    if self._decode_layer(i, L, x, rows, cos, sin, ffn=how,
                                          experts=(provider.table[i], chosen, chosen_w)):
                        provider.used(i, chosen, rows=len(rows))
                        self._read_ahead(i, L, x)
                        continue
                    if self._streamed_ffn(i, L, x, chosen, chosen_w):
                        continue
                    ctx.residual = x
                    x = x + self.ffn(i, L, self.norm(x, L.ffn_norm), ctx)
                    continue
            if how is None:
                x = self.family.layer(self, i, L, x, ctx)
                continue
            self._decode_layer(i, L, x, rows, cos, sin, ffn=how)
            if how == "attention":
                x = x + self.ffn(i, L, self.norm(x, L.ffn_norm), ctx)
        return x

    # -- the blocks a family's layer() is written in ----------------------------------------------

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return rms_norm(x, w, self.config.rms_eps)

    def attention(self, i: int, L: "Layer", x: np.ndarray, ctx: Ctx, window: int = 0, rope=None) -> np.ndarray:
        """Self-attention over each sequence's cache; `window` > 0: sliding; `rope`: other tables."""
        cos, sin = rope if rope is not None else (ctx.cos, ctx.sin)
        return self._attention(i, L, x, cos, sin, ctx.segments, ctx.adapter, window)

    def ffn(self, i: int, L: "Layer", x: np.ndarray, ctx: Ctx, act: str = "silu") -> np.ndarray:
        """The layer's FFN: SiLU-gated (dense or routed experts), or GELU-gated (`act="gelu"`)."""
        if act == "gelu":
            g, u = (self._mm(x, w, ctx.adapter) for w in (L.gate, L.up)) if ctx.adapter is not None \
                else matmul_many(x, [L.gate, L.up])
            return self._mm(ggml_round.geglu(g, u), L.down, ctx.adapter)
        residual, ctx.residual = ctx.residual, None
        return self._ffn(L, x, i, ctx.adapter, residual)

    def _decode_layer(self, i: int, L: Layer, x: np.ndarray, rows: list[tuple[KVCache, int]], cos, sin, ffn: str,
                      experts: tuple = (None, None)) -> bool:
        """Rows of x (B, n), row b at position rows[b][1] of the sequence in cache rows[b][0], through
        layer i's attention, and its FFN unless `ffn` is "attention" ("layer": dense, "moe":
        routed), in one compiled call — bit-identical to the step-by-step path, without dozens of
        Python-level calls per layer. x is updated in place. `experts`: (table, chosen) for
        streamed experts — their (E, 3) addresses in the cache (0: not resident), and where the
        chosen go; False when a chosen one was not resident and the FFN is left to the caller."""
        c = self.config
        seqs = [(*cache.layer_buffers(i), pos) for cache, pos in rows]
        if ffn == "layer":
            ffn = (L.ffn_norm, L.gate.raw, L.up.raw, int(L.gate.qtype), L.down.raw, int(L.down.qtype),
                   L.gate.shape[0])
        elif ffn == "moe":
            ffn = (L.ffn_norm, L.router.raw, L.gate_exps.raw, L.up_exps.raw, int(L.gate_exps.qtype),
                   L.down_exps.raw, int(L.down_exps.qtype), L.gate_exps.shape[1], c.n_expert,
                   c.n_expert_used, c.expert_weights_norm, *experts)
        else:
            ffn = None
        return kernels.compiled_module().decode_layer(
            x, L.attn_norm, c.rms_eps, (L.wq.raw, L.wk.raw, L.wv.raw), int(L.wq.qtype),
            L.wo.raw, int(L.wo.qtype), seqs, cos, sin, c.n_head, c.n_head_kv,
            c.head_dim, c.rope_dim, c.rope_style != "normal", ffn, 0, rows[0][0].dtype == np.float16,
            *self.attn_scales)

    @property
    def _fusable(self) -> list[str | None]:
        """How the one-call decode handles each layer: "layer" (plain llama attention and dense
        FFN), "moe" (plain attention and a routed FFN without a shared expert), "attention"
        (plain attention; the FFN stays in Python), or None. Plain: no biases, no q/k norm,
        compiled weights, q/k/v of one type, gate/up of one type."""
        if getattr(self, "_fusable_cache", None) is None:
            simd = kernels.compiled_module() is not None and kernels.kernel_info().get("avx2_fma")
            out = []
            for L in self.layers:
                attn = bool(simd) and L.bq is None and L.q_norm is None \
                    and all(w.compiled for w in (L.wq, L.wk, L.wv, L.wo)) and L.wq.qtype == L.wk.qtype == L.wv.qtype
                dense = L.router is None and all(w is not None and w.compiled for w in (L.gate, L.up, L.down)) \
                    and L.gate.qtype == L.up.qtype
                moe = L.router is not None and L.gate_shexp is None and L.router.compiled \
                    and L.router.qtype == kernels.Q.F32 \
                    and all(w.compiled for w in (L.gate_exps, L.up_exps, L.down_exps)) \
                    and L.gate_exps.qtype == L.up_exps.qtype and self.config.n_expert <= 256 \
                    and 1 <= self.config.n_expert_used <= 16
                out.append(("layer" if dense else "moe" if moe else "attention") if attn else None)
            self._fusable_cache = out
        return self._fusable_cache

    @staticmethod
    def _mm(x: np.ndarray, w: Weight, adapter) -> np.ndarray:
        y = matmul(x, w)
        if adapter is not None:
            d = adapter.delta(x, w)
            if d is not None:
                y += d
        return y

    def _attention(self, i: int, L: Layer, x: np.ndarray, cos, sin, segments: list, adapter=None,
                   window: int = 0) -> np.ndarray:
        c = self.config
        T = x.shape[0]
        mm = self._mm
        q, k, v = matmul_many(x, [L.wq, L.wk, L.wv])
        if adapter is not None:
            for y, w in ((q, L.wq), (k, L.wk), (v, L.wv)):
                d = adapter.delta(x, w)
                if d is not None:
                    y += d
        if L.bq is not None:
            q, k, v = q + L.bq, k + L.bk, v + L.bv
        if L.q_norm is not None and not L.qk_norm_per_head:       # olmoe: whole projection
            q, k = rms_norm(q, L.q_norm, c.rms_eps), rms_norm(k, L.k_norm, c.rms_eps)
        q = q.reshape(T, c.n_head, c.head_dim)
        k = k.reshape(T, c.n_head_kv, c.head_dim)
        v = v.reshape(T, c.n_head_kv, c.head_dim)
        if L.q_norm is not None and L.qk_norm_per_head:           # qwen3: per head
            q, k = rms_norm(q, L.q_norm, c.rms_eps), rms_norm(k, L.k_norm, c.rms_eps)
        q = apply_rope(np.ascontiguousarray(q), cos, sin, c.rope_style)
        k = apply_rope(np.ascontiguousarray(k), cos, sin, c.rope_style)
        q_scale, kq_scale = self.attn_scales
        if q_scale:
            q *= np.float32(q_scale)
        return mm(self.attend(i, q, k, v, segments, kq_scale or None, window), L.wo, adapter)

    @staticmethod
    def attend(i: int, q, k, v, segments: list, scale=None, window: int = 0, sinks=None) -> np.ndarray:
        """Store each sequence's new keys and values in layer i of its cache (a sliding-window
        layer keeps only its window) and attend over them: (T, H*d) for rows of all sequences."""
        outs = []
        for cache, a, b in segments:
            if window:
                keys, values, start = cache.store_window(i, k[a:b], v[a:b])
            else:
                (keys, values), start = cache.store(i, k[a:b], v[a:b]), cache.n
            outs.append(attention(q[a:b], keys, values, start, scale, window, sinks))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _ffn(self, L: Layer, x: np.ndarray, layer: int, adapter=None, residual=None) -> np.ndarray:
        if L.router is None:
            if adapter is None:
                return swiglu_ffn(x, L.gate, L.up, L.down)
            return swiglu_ffn(x, L.gate, L.up, L.down, lambda v, w: self._mm(v, w, adapter))
        c = self.config
        experts, weights = route(x, L.router, c.n_expert_used, c.expert_weights_norm)
        if self.expert_provider is None:
            out = moe_ffn(x, experts, weights, lambda e, xs: swiglu_ffn(xs, *L.expert(e)))
        else:
            out = self._streamed_moe(layer, L, x, experts, weights, residual)
        if L.gate_shexp is not None:
            gate = 1.0 / (1.0 + np.exp(-matmul(x, L.shared_gate_inp)))          # (T, 1)
            out += gate.astype(np.float32) * swiglu_ffn(x, L.gate_shexp, L.up_shexp, L.down_shexp)
        return out


    # -- streamed experts (native/streamed_moe.py) -----------------------------------------------

    def _read_ahead(self, layer: int, L: Layer, x: np.ndarray, normed: bool = False) -> None:
        streamed_moe.read_ahead(self, layer, L, x, normed)

    def _streamed_ffn(self, layer: int, L: Layer, x: np.ndarray, chosen: np.ndarray, chosen_w: np.ndarray) -> bool:
        return streamed_moe.compiled_ffn(self, layer, L, x, chosen, chosen_w)

    def _streamed_moe(self, layer: int, L: Layer, x: np.ndarray, experts, weights, residual=None) -> np.ndarray:
        return streamed_moe.python_ffn(self, layer, L, x, experts, weights, residual)


def load_model(path: str | os.PathLike, **kw) -> Model:
    check_weights(kw.get("weights", "mapped"))          # outside the try: the caller's mistake, not the file's
    try:
        return Model(path, **kw)
    except (OSError, ValueError) as e:  # memmap of a vanished file, reshape of a corrupt tensor
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path}: cannot load model: {e}") from e
