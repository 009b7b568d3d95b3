"""Where a forward's routed experts come from: the mapped file (`InRamExperts`), or an expert
cache (`StreamedExperts`, native/experts/cache.py) — and, streamed, how the next layer's experts
are guessed and read ahead while this one computes.

A MoE part (native/arch/parts.py) routes, then asks its batch's source for the experts' sum.
Streamed decode rows whose layer runs in one compiled call come to `compiled_ffn` when a chosen
expert was not resident (native/runners.py): compiled steps over the experts as they become
resident. Prompt chunks, and families outside the one-call path, go through `ffn`. Both sum the
experts in the in-RAM order, so streamed answers are the in-RAM bits.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..arch.parts import MoE
from ..blocks import moe_ffn, rms_norm, swiglu_ffn
from ..kernels import matmul

READ_AHEAD_MARGIN = 2      # predicted beyond top-k (the recall reported); the cache reads the ranks that pay


class InRamExperts:
    """Experts multiplied where the model's file maps them."""

    def prefetch(self, layer: int, experts, rows: int = 0) -> None:
        pass

    def weights(self, layer: int, moe, e: int):
        return moe.expert(e)

    def ffn(self, layer: int, moe, x: np.ndarray, experts, weights, residual=None) -> np.ndarray:
        if len(x) > 1 and _compiled_ffn(moe):      # a prompt: every expert in one call, the same bits
            out = np.zeros((len(x), x.shape[1]), np.float32)
            kernels.compiled_module().moe_ffn(
                np.ascontiguousarray(x, np.float32), np.ascontiguousarray(experts, np.int32),
                np.ascontiguousarray(weights, np.float32), moe.gate_exps.raw, moe.up_exps.raw,
                int(moe.gate_exps.qtype), moe.down_exps.raw, int(moe.down_exps.qtype), moe.gate_exps.shape[1],
                moe.gate_exps.shape[0], out, 0)
            return out
        return moe_ffn(x, experts, weights, lambda e, xs: swiglu_ffn(xs, *moe.expert(e)))


def _compiled_ffn(moe) -> bool:
    """Can the compiled prompt FFN take this MoE's experts (stacked, of types it multiplies, gate
    and up of one type)?"""
    g, u, d = moe.gate_exps, moe.up_exps, moe.down_exps
    return kernels.compiled_module() is not None and all(w.compiled and w.raw is not None for w in (g, u, d)) \
        and g.qtype == u.qtype and len(g.shape) == 3


IN_RAM = InRamExperts()


class StreamedExperts:
    """Experts from `cache`: an ExpertCache, or any provider of `prefetch` and `weights`."""

    def __init__(self, cache, layers: list, config):
        self.cache, self.layers, self.config = cache, layers, config

    @property
    def table(self) -> np.ndarray | None:
        """(layer, expert) -> where its projections are resident (0: not), for the compiled decode."""
        return getattr(self.cache, "table", None)

    def prefetch(self, layer: int, experts, rows: int = 0) -> None:
        self.cache.prefetch(layer, experts, rows=rows)

    def weights(self, layer: int, moe, e: int):
        return self.cache.weights(layer, e)

    def read_ahead(self, layer: int, x: np.ndarray, normed: bool = False) -> None:
        """Predict the next layer's experts — its router applied to this layer's hidden state
        under its own FFN norm (Eliseev & Mazur) — and start reading the ones not resident.
        `x`: the residual stream, or (normed) this layer's FFN input."""
        cache = self.cache
        if len(x) > 4 or layer + 1 >= len(self.layers) or not hasattr(cache, "read_ahead"):
            return
        here, there = self.layers[layer], self.layers[layer + 1]
        if not isinstance(there.ffn, MoE) or cache.resident[layer + 1] >= cache.n_expert:
            return
        if normed:
            h = x * np.divide(there.ffn_norm, here.ffn_norm, out=np.ones_like(here.ffn_norm), where=here.ffn_norm != 0)
        else:
            h = rms_norm(x, there.ffn_norm, self.config.rms_eps)
        k = min(self.config.n_expert, self.config.n_expert_used + READ_AHEAD_MARGIN)
        logits = matmul(h, there.ffn.router)
        cache.read_ahead(layer + 1, np.argsort(-logits, axis=-1, kind="stable")[:, :k])

    def compiled_ffn(self, layer: int, x: np.ndarray, chosen: np.ndarray, chosen_w: np.ndarray) -> bool:
        """The routed FFN of decode rows (x: the attention's residual, updated in place) whose
        chosen experts are not all resident, in compiled steps: the resident experts first, then
        — while the misses are read — the next layer predicted from the partial output and read
        ahead, then each expert as its read arrives. The operations and the sum are the one-call
        decode's, so the bits are the in-RAM ones. False (nothing done) when the layer's experts
        outnumber the cache's slots (the Python path takes them in waves)."""
        cache, c, L = self.cache, self.config, self.layers[layer]
        want = sorted(set(chosen.ravel().tolist()))
        if len(want) > cache.slots or not hasattr(cache, "run_ready"):
            return False
        B, k = chosen.shape
        ptrs = np.zeros((B, k, 3), np.uint64)
        done = np.zeros((B, k), np.uint8)
        dn = np.zeros((B, k, x.shape[1]), np.float32)
        run = kernels.compiled_module().moe_stream
        f = L.ffn
        spec = (L.ffn_norm, c.rms_eps, int(f.gate_exps.qtype), int(f.down_exps.qtype), f.gate_exps.shape[1])

        def step() -> int:
            ptrs[:] = self.table[layer][chosen]          # 0: not resident yet, skipped
            return run(x, *spec, chosen, chosen_w, ptrs, done, dn, 0)

        def look_ahead() -> None:                       # the residual plus the experts computed so far
            partial = x if done.all() else x + np.einsum("bk,bkn->bn", chosen_w * done, dn)
            self.read_ahead(layer, partial)
        cache.run_ready(layer, want, step, rows=B, before_wait=look_ahead)
        return True

    def ffn(self, layer: int, moe, x: np.ndarray, experts, weights, residual=None) -> np.ndarray:
        """A routed FFN whose experts come from the expert cache. The resident experts are
        computed first; then, while this layer's misses are still being read, the next layer's
        experts are predicted — its router applied to the partial output (the residual plus the
        resident experts' share: on the synthetic bench model 0.82 recall at top-k+2 with a third
        of the experts missing, against 0.74 from this layer's FFN input) — and read ahead, so
        the disk goes on to them without idling. The sum is moe_ffn's, in its order: the bits
        do not change. `residual`: the stream the output is added to (None: predict from x)."""
        cache = self.cache
        uniq = np.unique(experts)
        if not hasattr(cache, "run_layer"):              # a plain provider: prefetch, then fetch
            cache.prefetch(layer, uniq, rows=len(x))
            return moe_ffn(x, experts, weights, lambda e, xs: swiglu_ffn(xs, *cache.weights(layer, e)))
        rows_of = {int(e): np.nonzero(experts == e) for e in uniq}

        def compute(e, ws):
            return swiglu_ffn(x[rows_of[e][0]], *ws)

        def look_ahead(done: dict) -> None:
            if residual is None:
                self.read_ahead(layer, x, normed=True)
                return
            partial = residual.copy()
            for e, y in done.items():
                rows, slot = rows_of[e]
                partial[rows] += weights[rows, slot, None] * y
            self.read_ahead(layer, partial)
        ys = cache.run_layer(layer, uniq, compute, rows=len(x), before_wait=look_ahead)
        return moe_ffn(x, experts, weights, lambda e, xs: ys[e])
