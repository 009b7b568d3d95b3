"""Context shift (llama-server's --context-shift): an answer that reaches the end of the context
drops the older half of what follows the first n_keep tokens, the later keys turned back to
their new positions, and goes on.

Held to llama.cpp's own shift (tests/data/shift, made by tests/tools/make_shift_reference.py
through llama-cpp-python's llama_memory_seq_rm / seq_add, as llama-server's pre_decode calls
them): with a q8_0 cache (llama.cpp's flash attention, which Kiln's reproduces bit for bit)
every greedy token of 300–400, through one and two shifts, is llama.cpp's; with the default fp16
cache (llama.cpp's default graph; a 202-token prompt, shifted at step 53) every token through the first shift and 50 past it — after
which the two engines' fp16 arithmetic, equal only to within rounding after a shift (llama.cpp
keeps the kept cells where they were and refills the holes; Kiln moves them down), may part at
a close margin. And what a shift must leave behind: layer 0's keys as a fresh run at the new
positions makes them (to the rounding of turning a key twice), its values the same bytes."""

import json

import numpy as np
import pytest

from conftest import DATA, tiny_path
from kiln.native.generate import ContextLengthError, Finish, Sequence, Token, check_context
from kiln.native.model import load_model
from kiln.native.sampling import SamplingParams
from kiln.native.scheduler import Scheduler

SHIFT = DATA / "shift"


def greedy(ref: dict, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=len(ref["greedy_ids"]), context_shift=True, ignore_eos=True,
                          n_keep=ref["n_keep"], **kw)


def run(seq: Sequence, prompt: list[int], params: SamplingParams) -> tuple[list[int], Finish]:
    ids, fin = [], None
    for ev in seq.generate(prompt, params):
        if isinstance(ev, Token):
            ids.append(ev.id)
        else:
            fin = ev
    return ids, fin


@pytest.mark.parametrize("name", [pytest.param("smollm2-q8_0", marks=pytest.mark.slow),     # 300-400 tokens
                                  pytest.param("smollm2-q8_0-keep", marks=pytest.mark.slow),   # each: the whole
                                  "smollm2-f16-long"])                                         # suite's tier
def test_greedy_text_through_the_shifts_is_llama_cpps(default_model, name):
    ref = json.loads((SHIFT / f"{name}.json").read_text())
    default_model.use_kv_types(ref["kv"])
    try:
        ids, fin = run(Sequence(default_model, ref["n_ctx"]), ref["ids"], greedy(ref))
    finally:
        default_model.use_kv_types("f16")
    assert ref["shifts"] and fin.context_shifts == len(ref["shifts"]) and fin.reason == "length"
    upto = len(ids) if ref["kv"] != "f16" else ref["shifts"][0]["step"] + 50
    first = next((i for i, (a, b) in enumerate(zip(ids[:upto], ref["greedy_ids"])) if a != b), None)
    assert first is None, f"token {first} differs (llama.cpp shifted at steps {[s['step'] for s in ref['shifts']]})"


def test_the_scheduler_shifts_as_a_sequence_alone_does(default_model):
    """Through the worker's scheduler — batched with another request, prompt-lookup drafts
    checked — the answer is the same tokens."""
    ref = json.loads((SHIFT / "smollm2-q8_0.json").read_text())
    default_model.use_kv_types("q8_0")
    try:
        sched = Scheduler(default_model, ref["n_ctx"], slots=2)
        job = sched.submit(ref["ids"], greedy(ref), lambda: False)
        other = sched.submit(default_model.tokenizer.encode("Water boils at"),
                             SamplingParams(temperature=0.0, max_tokens=40), lambda: False)
        events = [job.events.get(timeout=120) for _ in range(len(ref["greedy_ids"]) + 1)]
        assert isinstance(other.events.get(timeout=60), Token)
    finally:
        default_model.use_kv_types("f16")
    assert [e.id for e in events[:-1]] == ref["greedy_ids"]
    assert events[-1].context_shifts == len(ref["shifts"])


@pytest.mark.parametrize("arch,kv", [("llama3", "f16"), ("qwen3", "f16"), ("llama", "q8_0"), ("llama", "q4_0"),
                                     ("deepseek2", "f16")])
def test_a_shift_leaves_layer_0_as_a_fresh_run_at_the_new_positions(arch, kv):
    """Layer 0's keys depend only on the token and its position: after a shift the moved ones
    must be what a fresh run of the kept tokens makes (rope-style normal with Llama 3's factors,
    neox; fp16 and quantized rows; MLA's rows, rotated in their last dimensions, with YaRN), and
    its values the very bytes."""
    m = load_model(tiny_path(arch))
    if m.config.head_dim % 32 and kv != "f16":
        pytest.skip("head_dim holds no q8_0/q4_0 block")
    m.use_kv_types(kv)
    toks = list(np.random.default_rng(0).integers(3, m.config.n_vocab, 100))
    cache = m.new_cache(128)
    m.forward(toks, cache)
    keep, drop = 10, 40
    m.shift_cache(cache, keep, drop)
    kept = toks[:keep] + toks[keep + drop:]
    fresh = m.new_cache(128)
    m.forward(kept, fresh)
    assert cache.n == fresh.n == len(kept) and cache.tokens == kept
    (k, v), (fk, fv) = cache.layer_buffers(0), fresh.layer_buffers(0)
    assert np.array_equal(v[:len(kept)].view(np.uint8), fv[:len(kept)].view(np.uint8))
    from kiln.native.kv_types import decode
    a, b = decode(k[:len(kept)], cache.k_rot), decode(fk[:len(kept)], fresh.k_rot)
    scale = np.abs(b).max()
    step = {"f16": 2e-3, "q8_0": 2e-2, "q4_0": 2e-1}[kv]       # a row's rounding, once more
    assert np.abs(a - b).max() <= step * scale, (np.abs(a - b).max(), scale)
    assert np.array_equal(a[:keep], b[:keep])
    # what follows n_keep holds what dropped tokens made: no other prompt may reuse it
    assert cache.common_prefix(kept + [5]) == keep


def test_what_cannot_shift_is_refused_by_name(default_model):
    p = SamplingParams(max_tokens=100)
    with pytest.raises(ContextLengthError, match="shorten the prompt"):
        check_context([1] * 60, p, 128, True)
    shifting = SamplingParams(max_tokens=100, context_shift=True)
    check_context([1] * 60, shifting, 128, True)                      # past the end, shifting: fine
    with pytest.raises(ContextLengthError, match="cannot shift"):
        check_context([1] * 60, shifting, 128, False)
    with pytest.raises(ContextLengthError, match="not for the prompt"):
        check_context([1] * 126, shifting, 128, True)
    gemma = load_model(tiny_path("gemma3"))                           # sliding-window layers
    assert not gemma.new_cache(64).can_shift
    with pytest.raises(ContextLengthError, match="cannot shift"):
        Sequence(gemma, 64).check([1] * 10, shifting)
    with pytest.raises(ValueError, match="n_keep"):
        SamplingParams(n_keep=-2).validate()
