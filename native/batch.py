"""The rows one forward computes — of one or more sequences, each appended to its own cache —
and what every block of that forward shares: rope tables, the caches, the adapter, where routed
experts come from. Its methods are the operations a layer's parts (native/arch/parts.py) are
written in: norm, project (the adapter's delta added), attend (keys and values stored in each
sequence's cache first).
"""

from __future__ import annotations

import numpy as np

from .blocks import attention, rms_norm, rope_tables
from .kernels import Weight, matmul, matmul_many
from .vision.mrope import section_of_pairs


_MIXED = object()            # Batch.adapter when the sequences have different adapters


class Batch:
    def __init__(self, model, positions: np.ndarray, segments: list, adapter=None):
        """`segments`: (cache, first row, end row) of each sequence; `positions`: each row's.
        `adapter`: one LoRA for every row, or a list — each segment's own (None: the base), the
        rows of several adapters in one forward as S-LoRA batches them."""
        c = self.config = model.config
        self.positions, self.segments = positions, segments
        self.adapters = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * len(segments)
        if len(self.adapters) != len(segments):
            raise ValueError(f"{len(self.adapters)} adapters for {len(segments)} sequences")
        # one adapter (or none) for every row: the whole-batch products; several: per segment
        self.adapter = self.adapters[0] if all(a is self.adapters[0] for a in self.adapters) else _MIXED
        self.any_adapter = any(a is not None for a in self.adapters)
        self.experts = model.experts              # the mapped file's, or an expert cache's (native/experts/source.py)
        self.attn_scales = model.attn_scales      # (q_scale, kq_scale) of the family
        self._rope = (c.rope_dim, c.rope_scale, model.rope_factors, model.rope_yarn)
        self.cos, self.sin = self._tables(c.rope_base)
        self._other_ropes: dict = {}
        self.residual: np.ndarray | None = None   # the stream an FFN's output is added to (streamed experts read ahead from it)
        self.scratch: dict = {}                   # what a runner works out once per batch (native/runners.py)
        self.spans: list = []                     # (first, end) rows of images attended both ways
        self.deepstack = None                     # (image rows, (rows, layers, n_embd) slices) — Qwen3-VL's

    def take_image_rows(self, x: np.ndarray, where: np.ndarray, rows: np.ndarray) -> None:
        """Image rows in place of embeddings at `where`; a row wider than the model (Qwen3-VL's
        deepstack slices after its first n_embd values) keeps the rest for after_layer."""
        n = self.config.n_embd
        if rows.shape[1] == n:
            x[where] = rows
            return
        layers = self.config.get("deepstack", 0)
        if rows.shape[1] != n * (1 + layers):
            raise ValueError(f"image rows of {rows.shape[1]} values for a model that reads {n} "
                             f"(and {layers} deepstack slices): they were made for another model")
        x[where] = rows[:, :n]
        self.deepstack = (np.flatnonzero(where), rows[:, n:].reshape(len(rows), layers, n))

    def after_layer(self, i: int, x: np.ndarray) -> None:
        """Layer i's output, before the next layer: Qwen3-VL adds each image row's i-th deepstack
        slice (llama.cpp: cur + a view of the input embeddings; a text row's slice is zeros)."""
        if self.deepstack is not None and i < self.deepstack[1].shape[1]:
            at, slices = self.deepstack
            x[at] += slices[:, i]

    @property
    def n_rows(self) -> int:
        return self.segments[-1][2]

    def _tables(self, base: float) -> tuple[np.ndarray, np.ndarray]:
        rope_dim, scale, factors, yarn = self._rope
        sections = self.config.get("rope_sections")
        sel = None if sections is None else \
            section_of_pairs(sections, rope_dim // 2, self.config.get("rope_interleaved", False))
        if self.positions.ndim == 1 and (sel is None or not (sel == 3).any()):
            return rope_tables(self.positions, rope_dim, base, scale, factors, yarn)
        # M-RoPE rows (time, height, width; a text row's three its one): each pair's angle from its
        # section's position, the fourth section's from 0 — ggml's mrope cache, whose angles are
        # the plain cache's
        T = len(self.positions)
        rows = self.positions if self.positions.ndim == 2 else np.repeat(self.positions[:, None], 3, 1)
        pos = np.concatenate([rows, np.zeros((T, 1), np.int64)], 1)
        cos, sin = (a.reshape(T, 4, -1) for a in rope_tables(pos.reshape(-1), rope_dim, base, scale, factors, yarn))
        pairs = np.arange(cos.shape[2])
        return np.ascontiguousarray(cos[:, sel, pairs]), np.ascontiguousarray(sin[:, sel, pairs])

    def rope(self, base: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) of these rows' positions; `base`: another rope base (gemma3's sliding layers)."""
        if base is None:
            return self.cos, self.sin
        if base not in self._other_ropes:
            self._other_ropes[base] = self._tables(base)
        return self._other_ropes[base]

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return rms_norm(x, w, self.config.rms_eps)

    def project(self, x: np.ndarray, w: Weight) -> np.ndarray:
        """x times w, and the adapter's low-rank delta where it names w."""
        y = matmul(x, w)
        self._add_delta(x, w, y)
        return y

    def project_many(self, x: np.ndarray, ws) -> list[np.ndarray]:
        """[project(x, w) for w in ws], the products in one call (one activation quantization)."""
        ys = matmul_many(x, list(ws))
        for y, w in zip(ys, ws):
            self._add_delta(x, w, y)
        return ys

    @property
    def mm(self):
        """How a block multiplies by a weight: the plain product, or the adapter-adding one."""
        return self.project if self.any_adapter else matmul

    def _add_delta(self, x: np.ndarray, w: Weight, y: np.ndarray) -> None:
        if self.adapter is None:
            return
        if self.adapter is not _MIXED:
            d = self.adapter.delta(x, w)
            if d is not None:
                y += d
            return
        for ad, (_, a, b) in zip(self.adapters, self.segments):      # each sequence its own adapter
            d = ad.delta(x[a:b], w) if ad is not None else None
            if d is not None:
                y[a:b] += d

    def attend(self, i: int, q, k, v, scale=None, window: int = 0, sinks=None) -> np.ndarray:
        """Store each sequence's new keys and values in layer i of its cache (a sliding-window
        layer keeps only its window) and attend over them: (T, H*d) for rows of all sequences."""
        outs = []
        for cache, a, b in self.segments:
            if window:
                keys, values, start = cache.store_window(i, k[a:b], v[a:b])
            else:
                (keys, values), start = cache.store(i, k[a:b], v[a:b]), cache.n
            outs.append(attention(q[a:b], keys, values, start, scale, window, sinks))
            for s, e in self.spans:         # an image's rows see the whole image (mtmd's non-causal decode)
                if a <= s and e <= b:
                    see = np.full(e - s, start + (e - a) - 1)
                    outs[-1][s - a:e - a] = attention(q[s:e], keys, values, start + (s - a), scale, window, sinks, see)
        return outs[0] if len(outs) == 1 else np.concatenate(outs)
