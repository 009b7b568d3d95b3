"""On the compiled path a token's logits do not depend on how the prompt was batched: so
prefix reuse, batched decode and a fresh run give the same bits (and the same greedy text)."""

import numpy as np
import pytest
from pathlib import Path

from conftest import tiny_path
from kiln.native import kernels
from kiln.native.model import load_model
from kiln.native.runners import blocks_runners

pytestmark = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled",
                                reason="batch invariance is a property of the compiled kernels")


def _chunks(model, ids, sizes):
    cache = model.new_cache()
    out, i = None, 0
    for n in sizes:
        out = model.forward(ids[i:i + n], cache, all_logits=True)
        i += n
    assert i == len(ids)
    return out[-1]


@pytest.mark.parametrize("which", ["default", "tiny-qwen2moe"])
def test_logits_are_identical_however_the_prompt_is_batched(which, default_model):
    model = default_model if which == "default" else load_model(tiny_path("qwen2moe"))
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it sleeps.")
    whole = _chunks(model, ids, [len(ids)])
    assert np.array_equal(whole, _chunks(model, ids, [1] * len(ids)))
    assert np.array_equal(whole, _chunks(model, ids, [5, 1, 7, len(ids) - 13]))


def test_a_batched_decode_step_equals_each_sequence_alone(default_model):
    m = default_model
    prompts = [m.tokenizer.encode(t) for t in ("Once upon a time", "The capital of France is", "def f(x):")]
    solo = []
    for p in prompts:
        c = m.new_cache()
        m.forward(p, c)
        solo.append(m.forward([42], c))
    caches = [m.new_cache() for _ in prompts]
    for p, c in zip(prompts, caches):
        m.forward(p, c)
    batched = m.forward_batch([42, 42, 42], caches)
    for row, alone in zip(batched, solo):
        assert np.array_equal(row, alone)


def test_decode_rows_and_a_prompt_chunk_in_one_forward_equal_each_alone(default_model):
    """forward_runs: two decode steps and the next 9 tokens of a third sequence's prompt in one
    forward (as the scheduler runs a prompt's chunk with the decode step) — each run's last
    logits and its cache afterwards are the bits of running it alone."""
    m = default_model
    prompts = [m.tokenizer.encode(t) for t in ("Once upon a time", "The capital of France is")]
    chunk = m.tokenizer.encode("def area(width, height): return width * height")[:9]
    head = m.tokenizer.encode("# geometry helpers")
    solo, solo_caches = [], []
    for p, run in ((prompts[0], [42]), (prompts[1], [7]), (head, chunk)):
        c = m.new_cache()
        m.forward(p, c)
        solo.append(m.forward(run, c))
        solo_caches.append(c)
    caches = [m.new_cache() for _ in range(3)]
    for p, c in zip((prompts[0], prompts[1], head), caches):
        m.forward(p, c)
    got = m.forward_runs([([42], caches[0]), ([7], caches[1]), (chunk, caches[2])])
    assert got.shape == (3, m.config.n_vocab)
    for row, alone in zip(got, solo):
        assert np.array_equal(row, alone)
    after_alone, after_together = (m.forward([5], c) for c in (solo_caches[2], caches[2]))
    assert np.array_equal(after_alone, after_together)
    with pytest.raises(ValueError, match="at least one token in every run"):
        m.forward_runs([([1], caches[0]), ([], caches[1])])


def test_the_scheduler_interleaves_requests_and_matches_solo_generation(default_model):
    from kiln.native.generate import Finish, Sequence
    from kiln.native.sampling import SamplingParams
    from kiln.native.scheduler import Scheduler
    m = default_model
    prompts = [m.tokenizer.encode(t) for t in ("Once upon a time", "The capital of France is", "def f(x):", "Hi")]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=10 + i) for i in range(4)]
    alone = []
    for p, sp in zip(prompts, params):
        alone.append([e.id for e in Sequence(m).generate(p, sp) if not isinstance(e, Finish)])
    sched = Scheduler(m, 2048, slots=2)                 # 4 requests, 2 slots: some must wait
    jobs = [sched.submit(p, sp, lambda: False) for p, sp in zip(prompts, params)]
    got = []
    for j in jobs:
        ids = []
        while True:
            ev = j.events.get(timeout=60)
            if isinstance(ev, Finish):
                break
            ids.append(ev.id)
        got.append(ids)
    assert got == alone


def test_an_fp16_kv_cache_is_read_correctly_by_the_compiled_attention(default_model):
    m = default_model
    ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    l32 = m.forward(ids, m.new_cache(dtype=np.float32), all_logits=True)
    l16 = m.forward(ids, m.new_cache(dtype=np.float16), all_logits=True)
    assert np.corrcoef(l32[-1], l16[-1])[0, 1] > 0.999
    top2 = np.sort(l32, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5            # rounding KV to fp16 may only move near-ties
    assert clear.sum() >= 5 and (l32.argmax(-1) == l16.argmax(-1))[clear].all()


def _fused_and_stepwise(m, run):
    """run() through the one-call compiled layers, and again through the step-by-step path."""
    fused = run()
    saved, m.runners = m.runners, blocks_runners(m.layers)
    try:
        return fused, run()
    finally:
        m.runners = saved


@pytest.mark.parametrize("v_from", ["Q6_K", "F16"])
def test_the_one_call_layer_takes_v_of_its_own_type(v_from):
    """Q4_K_M files keep v in Q6_K on some layers, q and k in Q4_K: the one-call layer multiplies
    v apart (with the same activations when its type quantizes them alike — a Q8_0 v beside
    Q5_0 q/k — or its own — an F16 v), and gives the step-by-step path's bits."""
    from kiln.native.runners import choose_runners
    m = load_model(tiny_path("llama-Q4_K_M"))
    other = load_model(tiny_path(f"llama-{v_from}"))            # the same weights, another type
    for L, o in zip(m.layers, other.layers):
        assert L.attn.wv.shape == o.attn.wv.shape and L.attn.wq.qtype != o.attn.wv.qtype
        L.attn.wv = o.attn.wv
    m.runners = choose_runners(m.layers, m.config, m.experts)
    assert all(r.kind.startswith("one call") for r in m.runners)
    ids = m.tokenizer.encode("one two three four five six")

    def decode():
        cache = m.new_cache(dtype=np.float16)
        out = [m.forward(ids, cache)]
        for _ in range(6):
            out.append(m.forward([int(np.argmax(out[-1]))], cache))
        return np.array(out)
    fused, stepwise = _fused_and_stepwise(m, decode)
    assert np.array_equal(fused, stepwise)


@pytest.mark.parametrize("kv", [np.float16, pytest.param(np.float32, marks=pytest.mark.slow)], ids=["fp16-kv", "f32-kv"])
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_the_one_call_decode_layer_equals_the_step_by_step_path(which, kv, default_model, e8k2_path):
    """Solo and batched decode steps (sequences of different lengths, so different positions and
    different experts per row), and a run of five rows of one sequence (each attending to the
    ones before it), through the compiled layer give the step-by-step path's bits."""
    m = default_model if which == "dense" else load_model(e8k2_path)
    assert [r.kind for r in m.runners] == [f"one call ({which})"] * len(m.layers)
    prompts = [m.tokenizer.encode(t) for t in ("Once upon a time, in a land far away,", "The capital of France is",
                                                 "def f(x):")]

    def decode(n=5):
        caches = [m.new_cache(dtype=kv) for _ in prompts]
        last = [m.forward(p, c) for p, c in zip(prompts, caches)]
        out = []
        for _ in range(n):                       # one sequence alone, then all three together
            last[0] = m.forward([int(np.argmax(last[0]))], caches[0])
            rows = m.forward_batch([int(np.argmax(x)) for x in last], caches)
            last = list(rows)
            out.append(rows)
        # a run of one sequence's tokens (a speculative draft being checked) through the same call
        run = m.forward([int(np.argmax(x)) for x in last] + [42, 7], caches[1], all_logits=True)
        return np.concatenate([np.array(out).reshape(-1, run.shape[-1]), run])
    fused, stepwise = _fused_and_stepwise(m, decode)
    assert np.array_equal(fused, stepwise)


@pytest.mark.slow
@pytest.mark.parametrize("kv", [np.float16, np.float32, "q8_0"], ids=["fp16-kv", "f32-kv", "q8_0-kv"])
def test_a_long_decode_with_heads_split_between_threads_keeps_the_bits(kv, default_model):
    """Past SPLIT_ATTENTION_FROM positions a decode step whose rows x heads do not divide among
    the threads (9 heads, 1 or 3 rows, 2 threads) deals each head's scores, softmax and value
    sums between them: the step-by-step path's bits, alone and batched."""
    m = default_model
    text = (Path(__file__).parent / "data" / "perplexity" / "GPL-3.txt").read_text()
    prompts = [m.tokenizer.encode(text)[:300 + 17 * i] for i in range(3)]
    # the prompts are prefilled once (the decode steps are what the two paths run differently);
    # each run starts from copies of those caches
    prefilled = [m.new_cache(dtype=kv) for _ in prompts]
    first = [m.forward(p, c) for p, c in zip(prompts, prefilled)]

    def decode():
        caches = [m.new_cache(dtype=kv) for _ in prompts]
        for c, done in zip(caches, prefilled):
            c.copy_from(done)
        last = list(first)
        out = []
        for _ in range(3):
            last[0] = m.forward([int(np.argmax(last[0]))], caches[0])
            out.append(last[0][None])
            last = list(m.forward_batch([int(np.argmax(x)) for x in last], caches))
            out.append(np.array(last))
        return np.concatenate(out)
    fused, stepwise = _fused_and_stepwise(m, decode)
    assert m.config.n_head % 2 == 1 and np.array_equal(fused, stepwise)


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "llama3", "qwen35", "qwen35moe", "gpt-oss", "deepseek2", "lfm2",
                                  "ernie4_5-moe"])
def test_new_families_batch_exactly_as_they_run_alone(arch):
    """Batched decode steps of the newer families (gemma3's sliding windows and own rope base,
    phi3's split projections, llama3's rope factors) give each sequence its solo tokens."""
    from conftest import tiny_path
    from kiln.native.generate import Finish, Sequence
    from kiln.native.model import load_model
    from kiln.native.sampling import SamplingParams
    from kiln.native.scheduler import Scheduler
    m = load_model(tiny_path(arch))
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 37)]           # past gemma3's 16-token window
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24) for i in range(3)]
    alone = [[e.id for e in Sequence(m).generate(p, sp) if not isinstance(e, Finish)] for p, sp in zip(prompts, params)]
    sched = Scheduler(m, 512, slots=3)
    jobs = [sched.submit(p, sp, lambda: False) for p, sp in zip(prompts, params)]
    got = []
    for j in jobs:
        ids = []
        while not isinstance(ev := j.events.get(timeout=60), Finish):
            ids.append(ev.id)
        got.append(ids)
    assert got == alone


@pytest.mark.parametrize(("arch", "how"), [("qwen2", "dense"), ("qwen2moe", "moe"), ("qwen3", "dense"), ("gpt-oss", "moe"),
                                         ("qwen3moe", "moe"), ("olmoe", "moe"), ("smollm3", "dense"), ("gemma3", "dense"),
                                         ("phi3", "dense"), ("qwen35", "dense"), ("qwen35moe", "moe"),
                                         ("ernie4_5-moe", ("dense", "moe")), ("lfm2", "dense"),
                                         ("deepseek2", ("dense", "moe")), ("deepseek2-wide", ("dense", "moe"))])
def test_families_decode_in_one_call(arch, how):
    """qwen2's q/k/v biases, qwen3's per-head q/k RMSNorm, smollm3's layers without RoPE, gemma3's
    sliding windows (16 positions in the tiny file: the 19-token prompt and the steps after it
    drop keys) with their own rope base, post-block norms and GELU FFN, gpt-oss's sinks, output
    bias, windows and biased experts, olmoe's q/k norms over the whole projection, and phi3's split
    projections, qwen35's gated attention (q and gate rows per head) and its delta-net layers (the
    conv, the recurrence, the gated norm: a delta layer's decode step is one call with its FFN)
    are part of the compiled layer: their decode steps (solo, batched, a short run) take the one
    call — a fall back to the blocks fails here — with the blocks' bits, qwen2moe's and
    qwen35moe's sigmoid-gated shared experts in the call with the routed ones, ernie4.5-moe's
    (a dense layer first) selection bias, renormalised weights and ungated shared expert, lfm2's
    gated short convolutions (a decode step's conv over the kept inputs, the state shifted),
    deepseek2's latent attention (the query absorbed through attn_k_b per head — F32 there, in
    ggml_vec_dot_f32's order —, one key row of kv_lora_rank + rope values, 576 in the wide file, the
    outputs through attn_v_b) with its sigmoid-routed experts and ungated shared one."""
    from kiln.native.arch.deepseek2 import LatentAttention
    from kiln.native.arch.lfm2 import ShortConv
    from kiln.native.arch.qwen35 import DeltaNet
    m = load_model(tiny_path(arch))
    hows = how if isinstance(how, tuple) else (how,) * len(m.layers)
    mixer = {DeltaNet: "delta net, ", ShortConv: "short conv, ", LatentAttention: "latent attention, "}
    assert [r.kind for r in m.runners] == [f"one call ({mixer.get(type(L.attn), '')}{h})" for L, h in zip(m.layers, hows)]
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73], [2, 4, 8, 16]]

    def decode():
        caches = [m.new_cache(dtype=np.float16) for _ in prompts]
        last = [m.forward(p, c) for p, c in zip(prompts, caches)]
        out = []
        for _ in range(4):
            rows = m.forward_batch([int(np.argmax(x)) for x in last], caches)
            last = list(rows)
            out.append(rows)
        run = m.forward([int(np.argmax(last[0])), 42, 7], caches[0], all_logits=True)
        return np.concatenate([np.array(out).reshape(-1, run.shape[-1]), run])
    fused, stepwise = _fused_and_stepwise(m, decode)
    assert np.array_equal(fused, stepwise)


@pytest.mark.parametrize("kv", [np.float32, "q8_0", "q4_0"], ids=["f32-kv", "q8_0-kv", "q4_0-kv"])
@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss"])
def test_windows_and_sinks_keep_the_bits_in_every_kind_of_cache(arch, kv):
    """The one call's sliding windows (their own buffers, keys dropped as the window moves) and
    sinks through the float32 and the quantized caches' attention (the fp16 one is above): a
    prompt past the window, decode steps alone and batched, a short run — the blocks' bits."""
    m = load_model(tiny_path(arch))
    prompts = [list(range(3, 43)), [2, 4, 8, 16, 32]]                 # 40 tokens: past both windows (16, 32)

    def decode():
        caches = [m.new_cache(dtype=kv) for _ in prompts]
        last = [m.forward(p, c) for p, c in zip(prompts, caches)]
        out = []
        for step in range(6):
            if step % 2:
                last[0] = m.forward([int(np.argmax(last[0]))], caches[0])
                out.append(last[0][None])
            rows = m.forward_batch([int(np.argmax(x)) for x in last], caches)
            last = list(rows)
            out.append(np.array(rows))
        out.append(m.forward([int(np.argmax(last[1])), 42, 7], caches[1], all_logits=True))
        return np.concatenate(out)
    fused, stepwise = _fused_and_stepwise(m, decode)
    assert np.array_equal(fused, stepwise)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "qwen35moe", "olmoe"])
def test_a_prompts_routed_ffn_in_one_call_is_the_expert_loops_bits(arch):
    """A prompt's routed experts in one compiled call (csrc/moe_rows.c) against the step-by-step
    loop over experts (blocks.moe_ffn): every row's bits, whatever rows each expert gets."""
    from kiln.native.blocks import moe_ffn, route, swiglu_ffn
    from kiln.native.experts.source import IN_RAM, _compiled_ffn
    m = load_model(tiny_path(arch))
    assert all(_compiled_ffn(L.ffn) for L in m.layers), "the one call must take these experts"
    c, rng = m.config, np.random.default_rng(3)
    for T in (2, 5, 37):
        for L in m.layers:
            moe = L.ffn
            x = rng.standard_normal((T, c.n_embd)).astype(np.float32)
            experts, weights = route(x, moe.router, c.n_expert_used, c.expert_weights_norm)
            one_call = IN_RAM.ffn(0, moe, x, experts, weights)
            loop = moe_ffn(x, experts, weights, lambda e, xs: swiglu_ffn(xs, *moe.expert(e)))
            assert np.array_equal(one_call, loop), f"{arch}: {T} rows"


def test_a_prompts_routed_ffn_takes_any_number_of_experts_a_row():
    """More experts a row than the decode call's 16 (a file may say so): the prompt's one call
    still gives the expert loop's bits, with rows choosing experts in any order."""
    from test_kernels import random_weight

    from kiln.native.arch.parts import MoE
    from kiln.native.blocks import moe_ffn, swiglu_ffn
    from kiln.native.experts.source import IN_RAM, _compiled_ffn
    from kiln.native.kernels import Q, Weight
    rng = np.random.default_rng(11)
    E, k, n, ff, T = 24, 20, 64, 96, 7

    def stack(rows, cols):
        ws = [random_weight(Q.Q8_0, rows, cols, rng) for _ in range(E)]
        return Weight("exps", Q.Q8_0, (E, rows, cols), np.stack([w.raw for w in ws]))
    moe = MoE(router=random_weight(Q.F32, E, n, rng), gate_exps=stack(ff, n), up_exps=stack(ff, n),
              down_exps=stack(n, ff))
    assert _compiled_ffn(moe)
    x = rng.standard_normal((T, n)).astype(np.float32)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0, 1, (T, k)).astype(np.float32)
    loop = moe_ffn(x, experts, weights, lambda e, xs: swiglu_ffn(xs, *moe.expert(e)))
    assert np.array_equal(IN_RAM.ffn(0, moe, x, experts, weights), loop)
