"""A loaded model: config, tokenizer, weights, and the forward pass.

What an architecture's layer holds and computes is declared by its family (native/arch/): this
module loads the tensors the family names and lets it build its layers from them. How each
layer runs — one compiled call per decode step, streamed experts, its blocks — is chosen once,
at load and when an expert cache is attached (native/runners.py); the forward is then

    x = embed(tokens)
    for run in runners: x = run(x, batch)
    logits = output(norm(x))

bit for bit the same whichever way a layer runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from . import kernels
from .arch import family
from .arch.parts import arrays
from .batch import Batch
from .blocks import rms_norm, yarn_params
from .context_shift import shift_cache
from .config import ModelConfig, check_tensors, read_config
from .experts.source import IN_RAM, StreamedExperts
from .gguf_file import GGUFError, GGUFFile, read_gguf
from .kernels import Weight, matmul
from .kv_cache import KVCache
from .kv_types import DEFAULT_KV_TYPE, check_head_dim, kv_type
from .runners import FUSED_RUN, BlocksLayer, blocks_runners, choose_runners
from .tokenizer import GGUFTokenizer
from .vision import mrope
from .vision.layout import MediaRows

__all__ = ["FUSED_RUN", "WEIGHTS", "Model", "check_weights", "load_model"]

# a split model's prompt rows go to the next stage in parts of about this many, so that the
# stages compute at once (a part is computed here while the one before is computed there)
PIPELINE_ROWS = 64

WEIGHTS = ("mapped", "private")


def check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights = {weights!r}: must be one of {', '.join(WEIGHTS)}")


class Model:
    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, weights: str = "mapped",
                 keep_mapped=(), stage: tuple[int, int] | None = None):
        """`weights`: "mapped" (views of the file's page cache) or "private" (copied into huge
        pages, native/private_weights.py) — all tensors but `keep_mapped` (a streamed model's
        experts, which the expert cache reads). `stage`: (first, end) — load only layers
        first..end-1, a pipeline stage's (native/stages.py); the first stage also embeds the
        tokens and computes the logits, and hands its rows to `remote` for the other layers."""
        t0 = time.perf_counter()
        check_weights(weights)
        self.path = Path(path)
        self.gguf: GGUFFile = read_gguf(self.path)
        self.config: ModelConfig = read_config(self.gguf)
        self.stage = range(self.config.n_layer) if stage is None else check_stage(stage, self.config)
        self.remote = None             # the later stages: fn(x, [(uid, start, rows)], keep) -> x[keep]
        if weights == "private":
            keep = set(keep_mapped)
            self.gguf.copy_to_private(n for n in self.gguf.tensors if n not in keep and self._holds(n))
        self.tokenizer = GGUFTokenizer(self.gguf)
        self._load(threads or min(4, os.cpu_count() or 1))
        self.expert_provider = None    # experts from the mapped file; the runners are chosen
        self.media = MediaRows()       # image rows by placeholder id (native/vision/layout.py)
        self.mrope = self.config.get("rope_sections") is not None    # rows placed by native/vision/mrope.py
        self.load_seconds = time.perf_counter() - t0

    # -- loading ------------------------------------------------------------------------------

    def _holds(self, tensor: str) -> bool:
        """Does this model (or stage) use `tensor`? A later stage: only its layers' blk.N.*."""
        if tensor.startswith("blk."):
            return int(tensor.split(".")[1]) in self.stage
        return self.stage.start == 0

    def _load(self, threads: int) -> None:
        g, c = self.gguf, self.config
        fam = self.family = family(c.arch)
        first = self.stage.start == 0
        names = ["token_embd.weight"] if first else []
        self.tied_output = "output.weight" not in g.tensors
        if not self.tied_output and first:
            names.append("output.weight")
        plan = {i: (fam.matrices(c, i), fam.vectors(c, i), fam.fused(c, i)) for i in self.stage}
        for mats, vecs, fused in plan.values():
            names += list(mats.values()) + list(fused)
        check_tensors(g, c)          # fail fast, before any work, on a missing or misshapen tensor (named)
        weights = kernels.load_weights(g, names, threads)
        vec = lambda n: kernels.load_vector(g, n)  # noqa: E731
        self.token_embd = weights["token_embd.weight"] if first else None
        self.output = (self.token_embd if self.tied_output else weights["output.weight"]) if first else None
        self.output_norm = vec(fam.output_norm) if first else None
        self.attn_scales = fam.attention_scales(c)
        self.embed_scale = fam.embed_scale(c)
        extra = {k: vec(n) for k, n in fam.model_tensors(g).items()}
        self.rope_factors = extra.get("rope_freqs")
        self._rope_long_short = (extra["rope_long"], extra["rope_short"]) if "rope_long" in extra else None
        self.rope_yarn = None
        if c.rope_scaling == "yarn":
            orig, fast, slow, _ = c.yarn
            self.rope_yarn = yarn_params(c.rope_dim, c.rope_base, c.rope_scale, orig or c.n_ctx_train, fast, slow,
                                         1.0, fam.yarn_attn_factor(c))
        elif c.rope_attn_factor != 1.0:
            self.rope_yarn = (0.0, 0.0, 0.0, c.rope_attn_factor)   # no ramp: cos/sin times the factor
        self.use_context(c.n_ctx_train)
        self.kv_types = (DEFAULT_KV_TYPE, DEFAULT_KV_TYPE)
        self.layers = [None] * c.n_layer   # each its family's dataclass (native/arch/parts.py); None: another stage's
        for i, (mats, vecs, fused) in plan.items():
            t = {k: weights[n] for k, n in mats.items()}
            for n, parts in fused.items():
                start = 0
                for fld, rows in parts:
                    t[fld] = weights[n].row_slice(f"{n}[{fld}]", start, start + rows)
                    start += rows
                if start != weights[n].shape[0]:
                    raise GGUFError(f"{g.path}: tensor {n!r} has {weights[n].shape[0]} rows, expected {start} "
                                    f"({' + '.join(f'{f} {r}' for f, r in parts)})")
            t |= {k: vec(n) for k, n in vecs.items()}
            self.layers[i] = fam.layer_weights(c, i, t)

    @property
    def expert_provider(self):
        """None: experts from the mapped file; else what streams them instead (an ExpertCache,
        native/experts/cache.py, or any provider of `prefetch` and `weights`)."""
        return self._expert_provider

    @expert_provider.setter
    def expert_provider(self, provider) -> None:
        self._expert_provider = provider
        self.experts = IN_RAM if provider is None else StreamedExperts(provider, self.layers, self.config)
        self.runners = choose_runners(self.layers, self.config, self.experts)

    @property
    def weight_bytes(self) -> int:
        """Bytes the engine holds for weights (float32 on the reference path)."""
        seen, total = set(), 0
        for w in [self.token_embd, self.output, self.output_norm] + [w for L in self.layers if L is not None
                                                                     for w in arrays(L)]:
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

    def use_kv_types(self, k: str, v: str | None = None) -> None:
        """The types of the caches new_cache makes from now on: keys k, values v (default k) —
        "f16", "q8_0" or "q4_0" (kv_types.py). Refused, naming why, when the model's head_dim is
        not a multiple of a block."""
        kt, vt = kv_type(k), kv_type(v or k)
        for t in (kt, vt):
            check_head_dim(t, self.config.head_dim)
        self.kv_types = (kt.name, vt.name)

    def new_cache(self, max_tokens: int | None = None, dtype=None, v_dtype=None) -> KVCache:
        """A cache of the model's kv_types unless told otherwise: fp16 keys and values by
        default, as llama.cpp keeps them — half the memory and traffic of float32, and, with the
        query and probabilities rounded as ggml rounds them, closer to llama.cpp (the E8K2
        variant meets its bars only so; float32 misses them, tests/data/README.md); q8_0/q4_0
        when the worker asks for them (kv_types.py)."""
        c = self.config
        windows = {i: c.get("sliding_window") for i in range(c.n_layer) if self.family.sliding(c, i)}
        k, v = self.kv_types if dtype is None else (dtype, v_dtype)
        return KVCache(c.n_layer, c.n_head_kv, c.head_dim, max_tokens or c.n_ctx_train, k,
                       self.family.recurrent_state(c), windows, v, held=self.stage)

    def shift_cache(self, cache: KVCache, n_keep: int, n_discard: int) -> None:
        shift_cache(self, cache, n_keep, n_discard)           # native/context_shift.py

    def can_shift_over(self, tokens) -> bool:
        """Can a context shift move these tokens? Never on an M-RoPE model (mrope.py), as llama.cpp."""
        return not self.mrope

    # -- forward ------------------------------------------------------------------------------

    def _positions(self, cache: KVCache, tokens) -> np.ndarray:
        """Where `tokens` appended to `cache` sit: the next indices, or M-RoPE's (mrope.py)."""
        if not self.mrope:
            return np.arange(cache.n, cache.n + len(tokens))
        return mrope.positions(self.media, cache, tokens, split=self.remote is not None)

    def forward(self, tokens: list[int], cache: KVCache, *, all_logits: bool = False,
                logits_from: int | None = None, adapter=None) -> np.ndarray:
        """Run `tokens` (appended after the cache's positions) through the model.

        Returns logits (T, n_vocab) if all_logits, (T - logits_from, n_vocab) for the rows from
        `logits_from` on, else (n_vocab,) for the last token. `adapter`: a LoRA (native/lora.py)
        added to the projections it names; the cache must have been filled with the same one."""
        c = self.config
        if not tokens:
            raise ValueError("forward() needs at least one token")
        self._check(tokens)
        keep = slice(None) if all_logits else slice(logits_from, None) if logits_from is not None else slice(-1, None)
        if self.remote is not None and len(tokens) >= 2 * PIPELINE_ROWS and adapter is None \
                and getattr(self.remote, "pipelines", False):
            rows = self._pipelined(tokens, cache, keep)
        else:
            cache.begin(tokens)
            rows = self._layers(np.asarray(tokens), self._positions(cache, tokens), [(cache, 0, len(tokens))],
                                adapter, keep)
            cache.commit(tokens)
        logits = matmul(rms_norm(rows, self.output_norm, c.rms_eps), self.output)
        return logits if (all_logits or logits_from is not None) else logits[0]

    def hidden(self, tokens: list[int], cache: KVCache, adapter=None) -> np.ndarray:
        """The final hidden states (T, n_embd) of `tokens`, after the output norm: what the
        output head would read, and what embeddings pool (llama.cpp's result_norm)."""
        c = self.config
        if not tokens:
            raise ValueError("hidden() needs at least one token")
        self._check(tokens)
        cache.begin(tokens)
        x = self._layers(np.asarray(tokens), self._positions(cache, tokens), [(cache, 0, len(tokens))],
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
        for toks, _ in runs:
            self._check(toks)
        segments, positions, at = [], [], 0
        for toks, cache in runs:
            cache.begin(toks)
            segments.append((cache, at, at + len(toks)))
            positions.append(self._positions(cache, toks))
            at += len(toks)
        last = self._layers(np.asarray([t for toks, _ in runs for t in toks]), mrope.stack(positions), segments,
                            adapter, np.array([b - 1 for _, _, b in segments]))
        for toks, cache in runs:
            cache.commit(toks)
        return matmul(rms_norm(last, self.output_norm, c.rms_eps), self.output)

    def _check(self, tokens: list[int]) -> None:
        """Every id a vocabulary token or a held image row (a ValueError naming the first that is not)."""
        n = self.config.n_vocab
        for t in tokens:
            if not 0 <= t < n and t not in self.media:
                raise ValueError(f"token id {t} is outside the vocabulary (0..{n - 1})" if t >= 0 else
                                 f"image row {t} is not held (send the image again)")

    def _layers(self, tokens: np.ndarray, positions: np.ndarray, segments: list, adapter=None,
                keep=slice(None)) -> np.ndarray:
        """The decoder stack over rows that belong to one or more sequences; `segments` lists
        (cache, first row, end row) for each sequence. Returns the rows `keep` selects (only
        those cross to a later stage and back)."""
        x = self._stack(tokens, positions, segments, adapter)
        if self.remote is None:
            return x[keep]
        if adapter is not None and any(a is not None for a in (adapter if isinstance(adapter, (list, tuple)) else [adapter])):
            raise ValueError("a model split across processes runs without adapters")
        try:
            return self.remote(x, [(cache.uid, cache.n, e - a) for cache, a, e in segments], keep)
        except BaseException as err:
            # what the later stages hold of these sequences is unknown now (a stage restarted, a
            # reply lost): start them over, so the next call sends every position again — and
            # when a stage said it lost them, send them again now, with these rows
            lost = getattr(err, "code", None) == "stage_state_lost"
            history = [list(cache.tokens[:cache.n]) for cache, _, _ in segments]
            for cache, _, _ in segments:
                cache.truncate(0)
            if not lost:
                raise
        return self._replay(tokens, segments, history, keep)

    def _replay(self, tokens: np.ndarray, segments: list, history: list, keep) -> np.ndarray:
        """The rows of `segments` again, each after its whole history (its cache now empty):
        what a later stage that restarted needs to hold these sequences again."""
        picked = np.arange(len(tokens))[keep]
        runs, moved, at = [], {}, 0
        for (cache, a, e), past in zip(segments, history):
            run = past + [int(t) for t in tokens[a:e]]
            for r in range(a, e):
                moved[r] = at + len(past) + r - a
            runs.append((run, cache, at))
            at += len(run)
        all_tokens = np.asarray([t for run, _, _ in runs for t in run])
        segs = [(cache, start, start + len(run)) for run, cache, start in runs]
        for run, cache, _ in runs:
            cache.begin(run)
        x = self._stack(all_tokens, np.concatenate([np.arange(len(run)) for run, _, _ in runs]), segs)
        out = self.remote(x, [(cache.uid, 0, len(run)) for run, cache, _ in runs], np.array([moved[r] for r in picked]))
        for (cache, _, _), past in zip(segments, history):
            cache.commit(past)               # the caller commits this call's own tokens after
        return out

    def _pipelined(self, tokens: list[int], cache: KVCache, keep, replayed: bool = False) -> np.ndarray:
        """A prompt's rows through a split model in parts: each part is sent on to the next stage
        as soon as this one has computed it, and the next part computed meanwhile — both stages
        work at once. The rows `keep` picks, as _layers gives them."""
        n0, T = cache.n, len(tokens)
        picked = np.arange(T)[keep]
        parts = -(-T // PIPELINE_ROWS)
        bounds = [T * i // parts for i in range(parts + 1)]
        pending = []
        try:
            for a, e in zip(bounds, bounds[1:]):
                part = tokens[a:e]
                cache.begin(part)
                x = self._stack(np.asarray(part), self._positions(cache, part), [(cache, 0, e - a)])
                mine = picked[(picked >= a) & (picked < e)] - a
                pending.append(self.remote.submit(x, [(cache.uid, cache.n, e - a)], mine))
                cache.commit(part)
            return np.concatenate([p.result() for p in pending])
        except BaseException as err:
            history = list(cache.tokens[:n0])
            cache.truncate(0)
            if replayed or getattr(err, "code", None) != "stage_state_lost":
                raise
        # a later stage lost the sequence (it restarted): every position again, these rows last
        return self._pipelined(history + list(tokens), cache, np.arange(n0, n0 + T)[keep], True)

    def run_stage(self, x: np.ndarray, segments: list, keep=slice(None)) -> np.ndarray:
        """A later stage's share of a forward: rows x (from the stage before) of the sequences in
        `segments` — (cache, first row, end row), each appended after its cache's positions —
        through this stage's layers; the rows `keep` selects."""
        for cache, a, e in segments:
            cache.begin(range(e - a))
        positions = np.concatenate([np.arange(cache.n, cache.n + e - a) for cache, a, e in segments])
        x = self._run(x, Batch(self, positions, segments), self.runners)
        for cache, a, e in segments:
            cache.commit([0] * (e - a))          # a later stage never sees the tokens
        return x[keep]

    def _stack(self, tokens: np.ndarray, positions: np.ndarray, segments: list, adapter=None) -> np.ndarray:
        batch = Batch(self, positions, segments, adapter)
        real = tokens >= 0
        if real.all():
            x = self.token_embd.rows(tokens)
            if self.embed_scale:
                x *= np.float32(self.embed_scale)
        else:               # image rows in place of embeddings; the scale is the tokens' only (llama.cpp's)
            x = np.empty((len(tokens), self.config.n_embd), np.float32)
            if real.any():
                x[real] = self.token_embd.rows(tokens[real])
                if self.embed_scale:
                    x[real] *= np.float32(self.embed_scale)
            batch.take_image_rows(x, ~real, self.media.rows(tokens[~real]))
            batch.spans = [(a + s, a + e) for _, a, b in segments for s, e in self.media.spans(tokens[a:b])]
            if batch.spans and not all(isinstance(r, BlocksLayer) for r in self.runners):
                return self._run(x, batch, blocks_runners(self.layers))   # the one-call kernel is causal only
        return self._run(x, batch, self.runners)

    @staticmethod
    def _run(x: np.ndarray, batch: Batch, runners: list) -> np.ndarray:
        for i, run in enumerate(runners):
            x = run(x, batch)
            batch.after_layer(i, x)
        return x


def check_stage(stage, config) -> range:
    first, end = stage
    if not (isinstance(first, int) and isinstance(end, int) and 0 <= first < end <= config.n_layer):
        raise ValueError(f"layers {first}..{end}: a stage is a range of the model's {config.n_layer} layers "
                         f"(first < end ≤ {config.n_layer})")
    return range(first, end)


def load_model(path: str | os.PathLike, **kw) -> Model:
    check_weights(kw.get("weights", "mapped"))          # outside the try: the caller's mistake, not the file's
    try:
        return Model(path, **kw)
    except (OSError, ValueError) as e:  # memmap of a vanished file, reshape of a corrupt tensor
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path}: cannot load model: {e}") from e
