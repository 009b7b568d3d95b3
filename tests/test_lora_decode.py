"""Adapters at full speed: a decode step with a LoRA runs in the one compiled call per layer (each
row's adapter added there — csrc/layer.c lora_rows), with the blocks' bits; sequences with
different adapters share one forward (as S-LoRA batches them), each row the bits it has alone.
Speed is bench/adapters.py's."""

import numpy as np
import pytest

from kiln.native import kernels, runners
from kiln.native.lora import LoraConfig, init_adapter

pytestmark = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled",
                                reason="the one-call decode is the compiled extension's")


def adapter(model, seed: int, targets=None):
    cfg = LoraConfig(16, 32.0) if targets is None else LoraConfig(8, 8.0, targets)
    ad = init_adapter(model, cfg, np.random.default_rng(seed))
    for _, b in ad.tensors.values():
        b[...] = np.random.default_rng(seed + 7).normal(0, 0.02, size=b.shape).astype(np.float32)
    return ad


PROMPT = [1, 2524, 2115, 253, 655, 665, 421]
STEPS = [314, 2000, 17, 900, 4242]


def decode(model, adapters, blocks=False):
    """Logits of each decode step of len(adapters) sequences in one batch."""
    saved = model.runners
    if blocks:
        model.runners = runners.blocks_runners(model.layers)
    try:
        caches = [model.new_cache(32) for _ in adapters]
        for c, ad in zip(caches, adapters):
            model.forward(PROMPT, c, adapter=ad)
        return np.stack([model.forward_runs([([t], c) for c in caches], list(adapters)) for t in STEPS])
    finally:
        model.runners = saved


def test_a_decode_step_with_an_adapter_runs_in_one_call_with_the_blocks_bits(default_model, monkeypatch):
    ad = adapter(default_model, 1)
    assert {r.kind for r in default_model.runners} == {"one call (dense)"}
    calls = []
    monkeypatch.setattr(type(default_model.layers[0]), "__call__",
                        lambda self, *a, _orig=type(default_model.layers[0]).__call__: calls.append(1) or _orig(self, *a))
    fast = decode(default_model, [ad])                  # a 7-token prompt is a short run: one call too
    assert not calls, f"{len(calls)} layer calls fell back to the blocks with an adapter"
    monkeypatch.undo()
    slow = decode(default_model, [ad], blocks=True)
    assert np.array_equal(fast, slow)
    base = decode(default_model, [None])
    assert not np.array_equal(fast, base), "the adapter must change the logits"


@pytest.mark.slow
def test_sequences_with_different_adapters_share_one_forward_with_their_own_bits(default_model):
    a1, a2 = adapter(default_model, 1), adapter(default_model, 2)
    attn_only = adapter(default_model, 3, ("attn_q", "attn_v"))
    mixed = [a1, None, a2, attn_only, a1]
    together = decode(default_model, mixed)
    alone = np.stack([decode(default_model, [ad])[:, 0] for ad in mixed], axis=1)
    assert np.array_equal(together, alone)
    assert np.array_equal(together, decode(default_model, mixed, blocks=True))


def test_a_prompt_chunk_riding_with_other_adapters_keeps_its_bits(default_model):
    """A prefill chunk in the same forward as decode steps of other adapters (the scheduler's
    rider): longer than a one-call run, so the blocks add each segment's own delta."""
    a1, a2 = adapter(default_model, 1), adapter(default_model, 2)
    c1, c2, d1, d2 = (default_model.new_cache(64) for _ in range(4))
    default_model.forward(PROMPT, c1, adapter=a1)
    default_model.forward(PROMPT, d1, adapter=a1)
    chunk = list(range(100, 130))
    together = default_model.forward_runs([([314], c1), (chunk, c2)], [a1, a2])
    assert np.array_equal(together[0], default_model.forward([314], d1, adapter=a1))
    assert np.array_equal(together[1], default_model.forward(chunk, d2, adapter=a2))


@pytest.mark.parametrize("arch", ["gemma3", "qwen35"])
def test_one_call_families_with_adapters_keep_the_blocks_bits(arch):
    """gemma3's one call (sliding window, post-block norms, GELU FFN) adds each row's adapter to
    the FFN's gate and up before the GELU, as its blocks do; qwen35's adds them to its gated q
    (query and gate rows alike) and to the FFN after a delta net: mixed adapters, the blocks' bits."""
    from conftest import tiny_path

    from kiln.native.lora import Adapter, base_names
    from kiln.native.model import load_model
    m = load_model(tiny_path(arch))
    assert all(r.kind.startswith("one call (") and r.kind.endswith("dense)") for r in m.runners)

    def gemma_adapter(seed):          # Kiln trains no adapter for these, but serves llama.cpp's
        rng = np.random.default_rng(seed)
        shapes = {n: m.gguf.tensor(n).shape for n in base_names(m.config.n_layer, LoraConfig(8, 16.0).targets)
                  if n in m.gguf.tensors}             # a delta-net layer has no attention projections
        return Adapter(arch, 16.0, {n: (rng.normal(0, 0.1, (8, i)).astype(np.float32),
                                            rng.normal(0, 0.1, (o, 8)).astype(np.float32)) for n, (o, i) in shapes.items()})
    a1, a2 = gemma_adapter(1), gemma_adapter(2)
    prompt, steps = list(range(3, 24)), [40, 41, 42, 43, 44]       # past the tiny file's 16-token window

    def run(blocks):
        saved = m.runners
        if blocks:
            m.runners = runners.blocks_runners(m.layers)
        try:
            caches = [m.new_cache(64) for _ in range(3)]
            for c, ad in zip(caches, (a1, None, a2)):
                m.forward(prompt, c, adapter=ad)
            return np.stack([m.forward_runs([([t], c) for c in caches], [a1, None, a2]) for t in steps])
        finally:
            m.runners = saved
    fast = run(False)
    assert np.array_equal(fast, run(True))
    assert not np.array_equal(fast[:, 0], fast[:, 1]), "the adapter must change the logits"


def test_an_adapter_on_a_weight_the_call_does_not_adapt_sends_that_layer_to_its_blocks(monkeypatch):
    """llama.cpp's adapters may name any weight (a delta net's ssm_out, phi3's fused attn_qkv):
    the one call adds only the seven projections, so a layer whose weight an adapter names
    beyond them takes its blocks — the decode steps keep the blocks' bits instead of dropping
    the delta — and the other layers keep the call."""
    from conftest import tiny_path

    from kiln.native.arch.parts import Layer
    from kiln.native.arch.qwen35 import DeltaNet
    from kiln.native.lora import Adapter
    from kiln.native.model import load_model
    m = load_model(tiny_path("qwen35"))
    i = next(j for j, L in enumerate(m.layers) if type(L.attn) is DeltaNet)
    rng = np.random.default_rng(4)
    o, n = m.gguf.tensor(f"blk.{i}.ssm_out.weight").shape
    ad = Adapter("qwen35", 16.0, {f"blk.{i}.ssm_out.weight": (rng.normal(0, 0.3, (8, n)).astype(np.float32),
                                                               rng.normal(0, 0.3, (o, 8)).astype(np.float32))})
    assert ad.targets == ["ssm_out"] and ad.other_layers == {i}
    taken = []
    monkeypatch.setattr(Layer, "__call__", lambda self, j, *a, _orig=Layer.__call__: taken.append(j) or _orig(self, j, *a))

    def run(blocks=False):
        saved = m.runners
        if blocks:
            m.runners = runners.blocks_runners(m.layers)
        try:
            caches = [m.new_cache(64) for _ in range(2)]
            for c, a in zip(caches, (ad, None)):
                m.forward([3, 4, 5, 6], c, adapter=a)
            taken.clear()
            return np.stack([m.forward_runs([([t], c) for c in caches], [ad, None]) for t in (40, 41, 42)])
        finally:
            m.runners = saved
    fast = run()
    assert set(taken) == {i}, f"only layer {i} takes its blocks in the decode steps, not {set(taken)}"
    assert np.array_equal(fast, run(blocks=True))
    assert not np.array_equal(fast[:, 0], fast[:, 1]), "the adapter must change the logits"


def test_an_adapter_naming_a_weight_nothing_adapts_is_refused_and_others_pass():
    """A router takes no adapter on any path: an adapter naming it would load and change
    nothing — refused, naming it. One naming a delta net's weights (the blocks add those) and
    the usual seven-projection adapter pass."""
    from conftest import tiny_path

    from kiln.native.lora import Adapter, AdapterError
    from kiln.native.model import load_model
    m = load_model(tiny_path("qwen2moe"))
    rng = np.random.default_rng(2)

    def pair(name, model):
        o, n = model.gguf.tensor(name).shape
        return rng.normal(0, 0.1, (4, n)).astype(np.float32), rng.normal(0, 0.1, (o, 4)).astype(np.float32)
    names = ("blk.1.ffn_gate_inp.weight", "blk.1.attn_q.weight")
    router = Adapter("qwen2moe", 4.0, {n: pair(n, m) for n in names})
    with pytest.raises(AdapterError, match=r"blk\.1\.ffn_gate_inp\.weight: .* without adapters"):
        router.check_applied(m)
    m35 = load_model(tiny_path("qwen35"))
    names = [n for n in m35.gguf.tensors if n.endswith(("ssm_out.weight", "attn_qkv.weight", "attn_q.weight"))]
    Adapter("qwen35", 4.0, {n: pair(n, m35) for n in names}).check_applied(m35)
    assert {n.split(".")[2] for n in names} == {"ssm_out", "attn_qkv", "attn_q"}
    Adapter("qwen2moe", 4.0, {"blk.0.attn_k.weight": pair("blk.0.attn_k.weight", m)}).check_applied(m)


@pytest.mark.parametrize("arch", ["gpt-oss", "qwen35"])
def test_an_adapter_on_attention_is_applied_by_every_family(arch):
    """gpt-oss's and Qwen 3.5's attention blocks multiplied q, k, v and the output without the
    adapter's deltas: an adapter naming them loaded and changed nothing. Its deltas now change the
    logits, and a zero adapter (B = 0) leaves every bit as it was."""
    from conftest import tiny_path

    from kiln.native.lora import Adapter
    from kiln.native.model import load_model
    m = load_model(tiny_path(arch))
    layer = next(i for i, L in enumerate(m.layers) if hasattr(L.attn, "wq"))      # an attention layer
    rng = np.random.default_rng(5)

    def make(zero):
        t = {}
        for name in ("attn_q", "attn_v", "attn_output"):
            n = f"blk.{layer}.{name}.weight"
            o, i = m.gguf.tensor(n).shape
            t[n] = (rng.normal(0, 0.1, (4, i)).astype(np.float32),
                    np.zeros((o, 4), np.float32) if zero else rng.normal(0, 0.1, (o, 4)).astype(np.float32))
        return Adapter(m.config.arch, 8.0, t)
    prompt = list(range(3, 14))
    base = m.forward(prompt, m.new_cache(32))
    assert np.array_equal(m.forward(prompt, m.new_cache(32), adapter=make(True)), base)
    assert not np.allclose(m.forward(prompt, m.new_cache(32), adapter=make(False)), base, atol=1e-4)


def test_an_fp16_adapter_file_stays_fp16_and_decodes_with_its_widened_bits(default_model, tmp_path):
    """llama.cpp's convert_lora_to_gguf writes fp16: loaded, its pairs stay fp16 (half the bytes a
    step reads) and every product widens each value exactly, so a batch mixing it with float32
    adapters gives each row the bits of the float32 copy — in the one call and in the blocks.
    Rank 6: the A pass's rows past a multiple of four and B's products shorter than a vector."""
    from kiln.native.lora import Adapter, load_adapter, save_adapter
    f32 = adapter(default_model, 4)
    small = init_adapter(default_model, LoraConfig(6, 12.0), np.random.default_rng(9))
    for _, b in small.tensors.values():
        b[...] = np.random.default_rng(10).normal(0, 0.05, size=b.shape).astype(np.float32)
    half = Adapter(small.arch, small.alpha, {n: (a.astype(np.float16), b.astype(np.float16))
                                             for n, (a, b) in small.tensors.items()})
    loaded = load_adapter(save_adapter(half, tmp_path / "half.gguf"))
    assert {x.dtype for ab in loaded.tensors.values() for x in ab} == {np.dtype(np.float16)}
    widened = Adapter(small.arch, small.alpha, {n: (a.astype(np.float32), b.astype(np.float32))
                                                for n, (a, b) in loaded.tensors.items()})
    fast = decode(default_model, [loaded, f32, None])
    assert np.array_equal(fast, decode(default_model, [widened, f32, None]))
    assert np.array_equal(fast, decode(default_model, [loaded, f32, None], blocks=True))
    assert not np.array_equal(fast[:, 0], fast[:, 2]), "the adapter must change the logits"


@pytest.mark.parametrize("field, value", [("f16", 2), ("f16", -1), ("r", 0), ("r", 5000), ("b", 0)])
def test_the_step_refuses_a_lora_entry_it_cannot_read(default_model, monkeypatch, field, value):
    """The compiled step reads each entry's element type, rank and B address from the table:
    one out of range is a ValueError naming what, never a read past an adapter."""
    ad = adapter(default_model, 1)
    real = runners.lora_table

    def hostile(i, b, ffn):
        t = np.frombuffer(real(i, b, ffn), runners.LORA_PAIR).copy()
        t[0][field] = value
        return t.tobytes()
    monkeypatch.setattr(runners, "lora_table", hostile)
    c = default_model.new_cache(32)
    with pytest.raises(ValueError, match="LoRA entry without B, of rank outside 1..4096 or of an element type"):
        default_model.forward([1, 2524], c, adapter=ad)
