"""How each layer runs, chosen once at load (and again when an expert cache is attached): the
forward is `for run in runners: x = run(x, batch)`.

    BlocksLayer    the layer's own forward (native/arch/): its parts through the compiled
                   products or numpy
    OneCallLayer   a llama-skeleton layer whose decode steps run in one compiled call — its
                   attention and its dense or routed FFN (or the attention alone, the FFN then
                   through its blocks); other batches through its blocks
    StreamedLayer  the same with routed experts from an expert cache: one call when the chosen
                   experts are resident, else compiled steps as they arrive
    DeltaNetLayer  a qwen35 delta-net layer whose decode steps (one row per sequence) run in one
                   compiled call with its dense FFN (or the FFN then through its blocks)
    ConvLayer      the same for an lfm2 short-convolution layer
    LatentLayer    a deepseek2 layer (multi-head latent attention) whose decode steps run in
                   one compiled call with its FFN (or the FFN then through its blocks)

Every way computes the same bits. What depends on the batch — a decode step or a short run of
one sequence's rows, against a prompt — is decided per call, inside the runner.
"""

from __future__ import annotations

import numpy as np

from . import ggml_round, kernels
from gguf import GGML_QUANT_SIZES

from .arch.deepseek2 import DeepSeekMoE, LatentAttention
from .arch.ernie import ErnieMoE
from .arch.gemma3 import Gemma3Layer, GeluFFN
from .arch.gpt_oss import BiasedMoE, SinkAttention
from .arch.lfm2 import ShortConv
from .arch.parts import FFN, Attention, BiasedAttention, Layer, MoE, NormedAttention, SharedExpertMoE
from .arch.qwen import ProjectionNormedAttention
from .arch.qwen35 import DELTA_MAX_WIDTH, DeltaNet, GatedAttention
from .arch.smollm3 import NoRopeAttention
from .experts.source import StreamedExperts

# the longest run of one sequence's rows a layer computes in one compiled call (a speculative
# draft and the token before it); longer runs (prompts) take the blocks
FUSED_RUN = 17
ONE_CALL_ROWS = 64         # and the most rows of a batch


def one_call_rows(b) -> list | None:
    """(cache, position) of each row when this batch may run a layer in one compiled call: a
    decode step (one row per sequence), or a short run of rows (a speculative draft being
    checked: a row at position p attends to the rows before it, whose keys the call stores
    before any row attends). None for longer runs, with caches of different types, or with the
    compiled path off. Worked out once per batch."""
    if "one_call_rows" not in b.scratch:
        segs = b.segments
        ok = b.n_rows <= ONE_CALL_ROWS and all(e - a <= FUSED_RUN for _, a, e in segs) \
            and len({cache.types for cache, _, _ in segs}) == 1 and kernels.compiled_module() is not None
        b.scratch["one_call_rows"] = [(cache, cache.n + r) for cache, a, e in segs for r in range(e - a)] if ok else None
    return b.scratch["one_call_rows"]


def call_rows(i: int, b) -> list | None:
    """one_call_rows for layer i, or None when a row's adapter names one of its weights the call
    does not adapt (lora.py Adapter.other_layers): the blocks then add every delta."""
    rows = one_call_rows(b)
    if rows is not None and b.any_adapter and any(ad is not None and i in ad.other_layers for ad in b.adapters):
        return None
    return rows


class BlocksLayer:
    """Layer i through its own forward: its parts, each through the compiled products or numpy."""
    kind = "blocks"

    def __init__(self, i: int, layer):
        self.i, self.layer = i, layer

    def __call__(self, x: np.ndarray, b) -> np.ndarray:
        return self.layer(self.i, x, b)


class OneCallLayer(BlocksLayer):
    """`ffn`: "dense" or "moe" (in the call), None (the FFN through its blocks)."""

    def __init__(self, i: int, layer: Layer, ffn: str | None):
        super().__init__(i, layer)
        self.ffn = ffn
        self.kind = f"one call ({ffn or 'attention'})"

    def __call__(self, x, b):
        rows = call_rows(self.i, b)
        if rows is None:
            return self.layer(self.i, x, b)
        L = self.layer
        decode_layer(self.i, L, x, rows, b, self.ffn)
        if self.ffn is None:
            b.residual = None
            x = x + L.ffn(self.i, b.norm(x, L.ffn_norm), b)
        return x


class StreamedLayer(BlocksLayer):
    """A layer whose experts come from the expert cache (`experts`, native/experts/source.py):
    one compiled call if the chosen experts are resident (the cache's table of where they are);
    else the call stops after the attention and routing, and the FFN runs in compiled steps as
    the experts arrive."""
    kind = "one call (streamed experts)"

    def __init__(self, i: int, layer: Layer, experts):
        super().__init__(i, layer)
        self.experts = experts

    def __call__(self, x, b):
        rows = call_rows(self.i, b)
        if rows is None:
            return self.layer(self.i, x, b)
        i, L, streamed = self.i, self.layer, self.experts
        chosen = np.empty((len(rows), b.config.n_expert_used), np.int32)
        chosen_w = np.empty(chosen.shape, np.float32)
        if decode_layer(i, L, x, rows, b, "moe", experts=(streamed.table[i], chosen, chosen_w)):
            streamed.cache.used(i, chosen, rows=len(rows))
            streamed.read_ahead(i, x)
            return x
        if streamed.compiled_ffn(i, x, chosen, chosen_w):
            return x
        b.residual = x
        return x + L.ffn(i, b.norm(x, L.ffn_norm), b)


class DeltaNetLayer(BlocksLayer):
    """A delta-net layer (arch/qwen35.py): a decode step — one row per sequence, the recurrence;
    longer runs take the blocks' chunked form — in one compiled call; `ffn` "dense" or "moe" (in
    the call, a shared expert too) or None (its blocks after it)."""

    def __init__(self, i: int, layer: Layer, ffn: str | None):
        super().__init__(i, layer)
        self.ffn = ffn
        self.kind = f"one call (delta net, {ffn or 'attention'})"

    def __call__(self, x, b):
        """A decode step in the call (then the FFN's blocks when it is not in it); otherwise the
        blocks."""
        if call_rows(self.i, b) is None or any(e - a != 1 for _, a, e in b.segments):
            return self.layer(self.i, x, b)
        self.call(x, b, lora_table(self.i, b, self.ffn == "dense") if b.any_adapter else None,
                  shared_spec(self.layer.ffn) if self.ffn == "moe" else None)
        if self.ffn is None:
            b.residual = None
            x = x + self.layer.ffn(self.i, b.norm(x, self.layer.ffn_norm), b)
        return x

    def call(self, x, b, lora, shared):
        """The compiled step: x (B, n) in place."""
        i, L, c = self.i, self.layer, b.config
        d = L.attn
        states = [(st["conv"], st["ssm"]) for st in (cache.recurrent_state(i) for cache, _, _ in b.segments)]
        ws = (d.wqkv, d.wgate, d.ssm_beta, d.ssm_alpha, d.ssm_out)
        kernels.compiled_module().decode_delta_layer(
            x, L.attn_norm, c.rms_eps, tuple(w.raw for w in ws), tuple(int(w.qtype) for w in ws), d.spec(), d.dims(c),
            states, ffn_spec(L, c, self.ffn), 0, lora, shared)


class ConvLayer(DeltaNetLayer):
    """An lfm2 gated short-convolution layer (arch/lfm2.py): a decode step — one row per
    sequence, the conv over its kept inputs; longer runs take the blocks — in one compiled call
    with its FFN (or the FFN then through its blocks)."""

    def __init__(self, i: int, layer: Layer, ffn: str | None):
        super().__init__(i, layer, ffn)
        self.kind = f"one call (short conv, {ffn or 'attention'})"

    def call(self, x, b, lora, shared):
        i, L, c = self.i, self.layer, b.config
        a = L.attn
        kernels.compiled_module().decode_conv_layer(
            x, L.attn_norm, c.rms_eps, (a.in_proj.raw, a.out_proj.raw), (int(a.in_proj.qtype), int(a.out_proj.qtype)),
            a.conv, [cache.recurrent_state(i)["conv"] for cache, _, _ in b.segments], ffn_spec(L, c, self.ffn), 0,
            lora, shared)


class LatentLayer(OneCallLayer):
    """A deepseek2 layer: decode steps (and short runs) with the latent attention, its products
    and its FFN in one compiled call; prompts, and rows with adapters (the call adapts none of
    its projections), through its blocks."""

    def __init__(self, i: int, layer: Layer, ffn: str | None):
        super().__init__(i, layer, ffn)
        self.kind = f"one call (latent attention, {ffn or 'attention'})"

    def __call__(self, x, b):
        rows = call_rows(self.i, b)
        if rows is None or b.any_adapter:
            return self.layer(self.i, x, b)
        i, L, c = self.i, self.layer, b.config
        a, f = L.attn, L.ffn
        R, C = c.rope_dim, c.get("kv_lora_rank")
        ws = (a.wq, a.wq_a, a.wq_b, a.wkv_a, a.wk_b, a.wv_b, a.wo)
        cos, sin = b.rope()
        kernels.compiled_module().decode_mla_layer(
            x, L.attn_norm, c.rms_eps, tuple(None if w is None else w.raw for w in ws),
            tuple(-1 if w is None else int(w.qtype) for w in ws), (a.q_a_norm, a.kv_a_norm),
            (c.n_head, C, R, c.get("k_mla") - R, c.get("v_head")), [(*cache.layer_buffers(i), pos) for cache, pos in rows],
            cos, sin, c.rope_style != "normal", (rows[0][0].k_type.ggml, rows[0][0].v_type.ggml), float(b.attn_scales[1]),
            ffn_spec(L, c, self.ffn), 0, shared_spec(f) if self.ffn == "moe" else None)
        if self.ffn is None:
            b.residual = None
            x = x + f(i, b.norm(x, L.ffn_norm), b)
        return x


def _latent_compiled(a: LatentAttention, c) -> bool:
    """Does the call multiply each of the latent attention's weights at its width?"""
    R, C, vd, n = c.rope_dim, c.get("kv_lora_rank"), c.get("v_head"), c.n_embd
    widths = [(a.wkv_a, n), (a.wk_b, c.get("k_mla") - R), (a.wv_b, C), (a.wo, c.n_head * vd)]
    widths += [(a.wq, n)] if a.wq is not None else [(a.wq_a, n), (a.wq_b, a.q_a_norm.shape[0])]
    return all(_compiled(w) and K % GGML_QUANT_SIZES[w.qtype][0] == 0 for w, K in widths)


def decode_layer(i: int, L: Layer, x: np.ndarray, rows: list, b, ffn: str | None, experts: tuple = (None, None)) -> bool:
    """Rows of x (B, n), row r at position rows[r][1] of the sequence in cache rows[r][0], through
    layer i's attention, and its FFN unless `ffn` is None ("dense", or "moe": routed), in one
    compiled call — bit-identical to the blocks, without dozens of Python-level calls per
    layer. x is updated in place. `experts`: (table, chosen, weights) for streamed experts —
    their (E, 3) addresses in the cache (0: not resident), and where the chosen go; False when
    a chosen one was not resident and the FFN is left to the caller."""
    c, a, f = b.config, L.attn, L.ffn
    if a.window:              # a sliding-window layer's own buffers, rows indexed from their start
        seqs = []
        for cache, start, end in b.segments:
            kb, vb, at = cache.window_room(i, end - start)
            seqs += [(kb, vb, at + r) for r in range(end - start)]
    else:
        seqs = [(*cache.layer_buffers(i), pos) for cache, pos in rows]
    gemma = isinstance(L, Gemma3Layer)
    spec = ffn_spec(L, c, ffn, experts)
    cos, sin = b.rope(a.rope_base)
    return kernels.compiled_module().decode_layer(
        x, L.attn_norm, c.rms_eps, (a.wq.raw, a.wk.raw, a.wv.raw), (int(a.wq.qtype), int(a.wv.qtype)),
        a.wo.raw, int(a.wo.qtype), seqs, cos, sin, c.n_head, c.n_head_kv,
        c.head_dim, 0 if isinstance(a, NoRopeAttention) else c.rope_dim, c.rope_style != "normal", spec, 0, (rows[0][0].k_type.ggml, rows[0][0].v_type.ggml),
        *b.attn_scales, lora_table(i, b, ffn == "dense") if b.any_adapter else None,
        (a.q_norm, a.k_norm) if isinstance(a, NormedAttention) else
        (a.q_norm, a.k_norm, True) if isinstance(a, ProjectionNormedAttention) else None,
        (a.bq, a.bk, a.bv) if isinstance(a, BiasedAttention) else None, a.window,
        (L.post_attn_norm, L.post_ffn_norm) if gemma else None,
        ggml_round.gelu_table() if isinstance(f, GeluFFN) else None,
        *((a.bo, a.sinks) if isinstance(a, SinkAttention) else (None, None)),
        (f.router_b, f.gate_b, f.up_b, f.down_b) if ffn == "moe" and isinstance(f, BiasedMoE) else None,
        isinstance(a, GatedAttention), shared_spec(f) if ffn == "moe" else None)


def ffn_spec(L: Layer, c, ffn: str | None, experts: tuple = (None, None)) -> tuple | None:
    """The call's FFN argument: "dense" (its norm, gate, up, down and types), "moe" (the router
    and the stacked experts; `experts`: the streamed ones' table and outputs), None (not in the call)."""
    f = L.ffn
    if ffn == "dense":
        return L.ffn_norm, f.gate.raw, f.up.raw, int(f.gate.qtype), f.down.raw, int(f.down.qtype), f.gate.shape[0]
    if ffn == "moe":
        return (L.ffn_norm, f.router.raw, f.gate_exps.raw, f.up_exps.raw, int(f.gate_exps.qtype),
                f.down_exps.raw, int(f.down_exps.qtype), f.gate_exps.shape[1], c.n_expert,
                c.n_expert_used, f.norm if isinstance(f, DeepSeekMoE) else isinstance(f, ErnieMoE) or c.expert_weights_norm,
                f.rule() if isinstance(f, ErnieMoE) else None, *experts)
    return None


def shared_spec(f) -> tuple | None:
    """A routed FFN's shared expert as the call takes it — gated (qwen2moe, qwen35moe) or not
    (ernie4.5-moe, deepseek2) —, or None."""
    if type(f) is not SharedExpertMoE and getattr(f, "gate_shexp", None) is None:
        return None
    gate = f.shared_gate.raw.view(np.float32).reshape(-1) if type(f) is SharedExpertMoE else None
    return (gate, f.gate_shexp.raw, f.up_shexp.raw, int(f.gate_shexp.qtype),
            f.down_shexp.raw, int(f.down_shexp.qtype), f.gate_shexp.shape[0])


# a LoRA on each projection of a row, as csrc/layer.h's LoraPair: A and B by address, float32 or fp16
LORA_PAIR = np.dtype([("a", "<u8"), ("b", "<u8"), ("r", "<i4"), ("scale", "<f4"), ("f16", "<i4"), ("unused", "<i4")])
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


_NO_LORA = np.zeros(len(LORA_TARGETS), LORA_PAIR).tobytes()


def lora_row(ad, i: int, ffn: bool) -> bytes:
    """One row's entries for layer i, made once per adapter (a decode step reads them 30 times);
    as bytes, so a batch's table is a join (concatenating structured arrays cost 10 % of a
    135M model's 4-adapter step)."""
    if ad is None:
        return _NO_LORA
    key = (i, ffn)
    row = ad.compiled.get(key)
    if row is None:
        entries = np.zeros(len(LORA_TARGETS), LORA_PAIR)
        for t, (name, pair) in enumerate(zip(LORA_TARGETS, ad.layer_pairs(i))):
            if pair is not None and (ffn or not name.startswith("ffn_")):
                entries[t] = pair
        row = ad.compiled[key] = entries.tobytes()
    return row


def lora_table(i: int, b, ffn: bool) -> bytes:
    """Layer i's LoRA pairs for each row of a one-call batch (B x 7 LORA_PAIR; zeros: no adapter
    there). The FFN's only when the call runs it densely — else the blocks add them."""
    return b"".join([lora_row(ad, i, ffn) for ad, (_, a, e) in zip(b.adapters, b.segments) for _ in range(e - a)])


# -- the choice ------------------------------------------------------------------------------

def choose_runners(layers: list, config, experts) -> list:
    """A runner per layer, by what the compiled extension can do with it and where its experts
    come from (`experts`: native/experts/source.py's IN_RAM or a StreamedExperts)."""
    out = []
    for i, L in enumerate(layers):
        if L is None:                     # another pipeline stage's layer
            continue
        how = one_call(L, config)
        if how == "moe" and isinstance(experts, StreamedExperts) and type(L.attn) in (DeltaNet, ShortConv, LatentAttention):
            how = "attention"             # streamed experts come through the blocks after these mixers
        if how is not None and type(L.attn) is LatentAttention:
            out.append(LatentLayer(i, L, None if how == "attention" else how))
        elif how is not None and type(L.attn) in (DeltaNet, ShortConv):
            out.append((DeltaNetLayer if type(L.attn) is DeltaNet else ConvLayer)(i, L, None if how == "attention" else how))
        elif how is None:
            out.append(BlocksLayer(i, L))
        elif how == "moe" and isinstance(experts, StreamedExperts):
            # a plain provider, or gpt-oss's biased experts (the streamed call has no biases):
            # experts fetched through the blocks
            out.append(StreamedLayer(i, L, experts) if experts.table is not None and type(L.ffn) is MoE
                       else OneCallLayer(i, L, None))
        else:
            out.append(OneCallLayer(i, L, None if how == "attention" else how))     # None: the FFN through its blocks
    return out


def blocks_runners(layers: list) -> list:
    """Every layer through its blocks (what the one-call decode is checked against)."""
    return [BlocksLayer(i, L) for i, L in enumerate(layers) if L is not None]


def one_call(L, c) -> str | None:
    """How the one-call decode takes a layer: "dense" (llama attention and a dense FFN), "moe"
    (and routed experts — ernie4.5-moe's and deepseek2's rule too —, with a shared expert, gated
    or not, or without), "attention" (the FFN through its blocks), or None.
    The call computes exactly the llama skeleton of plain attention, with qwen2's q/k/v biases,
    qwen3's per-head q/k norm (olmoe's over the whole projection) or no RoPE (smollm3's NoPE layers: a rotation of 0 dimensions),
    gpt-oss's (sinks, the output's bias, a window, its biased experts and swiglu-oai), and gemma3's layer (a sliding window with its own rope base, the blocks' outputs RMS-normed,
    a GELU-gated FFN — in the call only), qwen35's gated attention (q and gate rows per head) and
    its delta nets (a call of their own, DeltaNetLayer), lfm2's short convolutions (ConvLayer), deepseek2's latent
    attention (LatentLayer) — so only a `Layer` of exactly those parts qualifies,
    with weights the extension multiplies: q and k of one type (v may have its own), gate/up of
    one type."""
    if not kernels.one_call_decode() or type(L) not in (Layer, Gemma3Layer) \
            or type(L.attn) not in (Attention, NormedAttention, BiasedAttention, NoRopeAttention, SinkAttention,
                                    ProjectionNormedAttention, GatedAttention, DeltaNet, ShortConv, LatentAttention):
        return None
    a, f = L.attn, L.ffn
    if type(a) is ShortConv:
        if not (_compiled(a.in_proj) and _compiled(a.out_proj)) or not 2 <= a.conv.shape[1] <= 64:
            return None
    elif type(a) is LatentAttention:
        if not _latent_compiled(a, c) or a.window:
            return None
    elif type(a) is DeltaNet:
        if not all(_compiled(w) for w in (a.wqkv, a.wgate, a.ssm_beta, a.ssm_alpha, a.ssm_out)) \
                or max(a.dims(c)[2:4]) > DELTA_MAX_WIDTH or a.dims(c)[4] > 64 or max(a.dims(c)[:2]) > 4096:
            return None
    elif not all(_compiled(w) for w in (a.wq, a.wk, a.wv, a.wo)) or a.wq.qtype != a.wk.qtype:
        return None
    dense = all(_compiled(w) for w in (f.gate, f.up, f.down)) and f.gate.qtype == f.up.qtype \
        if type(f) in (FFN, GeluFFN) else False
    if type(L) is Gemma3Layer or type(f) is GeluFFN:      # its norms and GELU exist only inside the call
        return "dense" if dense and type(L) is Gemma3Layer else None
    if dense:
        return "dense"
    shared_ok = getattr(f, "gate_shexp", None) is None or (
        all(_compiled(w) for w in (f.gate_shexp, f.up_shexp, f.down_shexp)) and f.gate_shexp.qtype == f.up_shexp.qtype
        and (type(f) is not SharedExpertMoE or f.shared_gate.qtype == kernels.Q.F32))
    if type(f) in (MoE, BiasedMoE, SharedExpertMoE, ErnieMoE, DeepSeekMoE) and shared_ok and _compiled(f.router) and f.router.qtype == kernels.Q.F32 \
            and all(_compiled(w) for w in (f.gate_exps, f.up_exps, f.down_exps)) \
            and f.gate_exps.qtype == f.up_exps.qtype and c.n_expert <= 256 and 1 <= c.n_expert_used <= 16:
        return "moe"
    return "attention"


def _compiled(w) -> bool:
    """Does the extension multiply this weight's stored blocks (whether it is switched on now or not)?"""
    return w.raw is not None and w.qtype in kernels.COMPILED_TYPES
