"""Sampling chain, seeds, stop strings, penalties, logprobs."""

import numpy as np
import pytest

from kiln.native.generate import ContextLengthError, Finish, Sequence, Token, generate_text
from kiln.native.sampling import Sampler, SamplingError, SamplingParams, top_ranked


def _logits(values):
    return np.asarray(values, dtype=np.float32)


def test_greedy_takes_the_argmax():
    assert Sampler(SamplingParams(temperature=0)).sample(_logits([0, 3, 1]), []) == 1


def test_top_k_one_is_greedy_at_any_temperature():
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=1))
    assert {s.sample(_logits([0, 3, 2.9]), []) for _ in range(50)} == {1}


def test_min_p_and_top_p_cut_the_tail():
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=0))
    assert {s.sample(_logits([10, 9.9, 0, 0]), []) for _ in range(200)} <= {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0, seed=0))
    assert {s.sample(_logits([10, 5, 5, 5]), []) for _ in range(200)} == {0}


def test_same_seed_same_draws_other_seed_other_draws():
    logits = _logits(np.linspace(0, 1, 50))
    def draw(seed):
        s = Sampler(SamplingParams(temperature=1, top_k=0, min_p=0, seed=seed))
        return [s.sample(logits, []) for _ in range(30)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_penalties_lower_repeated_tokens():
    s = Sampler(SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    out = s.apply_penalties(_logits([4.0, -4.0, 4.0]), [0, 0, 1])
    assert out[0] == pytest.approx(4.0 / 2 - 0.5 - 0.5)
    assert out[1] == pytest.approx(-4.0 * 2 - 0.5 - 0.25)
    assert out[2] == 4.0


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("min_p", 2),
                                         ("max_tokens", -5), ("logprobs", 99), ("stop", [""])])
def test_out_of_range_parameters_are_named(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value}).validate()


def test_unknown_parameter_is_refused():
    with pytest.raises(SamplingError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.fixture(scope="module")
def chat_prompt(default_model):
    from kiln.native.chat_template import template_for
    text = template_for(default_model).render([{"role": "user", "content": "What is 2+2?"}])
    return default_model.tokenizer.encode(text)


def test_seeded_generation_repeats(default_model, chat_prompt):
    p = SamplingParams(temperature=0.9, seed=42, max_tokens=20)
    assert generate_text(default_model, chat_prompt, p)[0] == generate_text(default_model, chat_prompt, p)[0]


def test_stop_string_across_tokens_is_cut_and_never_leaks(default_model, chat_prompt):
    ids, full, _ = generate_text(default_model, chat_prompt, SamplingParams(temperature=0, max_tokens=40))
    # pick a stop string that spans a token boundary of the greedy answer
    pieces = [default_model.tokenizer.decode([i]) for i in ids]
    boundary = len(pieces[0]) + len(pieces[1])
    stop = full[boundary - 2: boundary + 2]
    assert len(stop) == 4
    _, text, fin = generate_text(default_model, chat_prompt,
                                 SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    assert fin.reason == "stop"
    assert text == full[:full.index(stop)]


def test_eos_ends_generation_unless_ignored(default_model, chat_prompt):
    _, _, fin = generate_text(default_model, chat_prompt, SamplingParams(temperature=0, max_tokens=100))
    assert fin.reason == "stop" and fin.completion_tokens < 100
    _, _, fin = generate_text(default_model, chat_prompt,
                              SamplingParams(temperature=0, max_tokens=fin.completion_tokens + 3, ignore_eos=True))
    assert fin.reason == "length"


def test_logprobs_are_log_probabilities(default_model, chat_prompt):
    events = list(Sequence(default_model).generate(
        chat_prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=5)))
    toks = [e for e in events if isinstance(e, Token)]
    for t in toks:
        assert t.logprob <= 0 and len(t.top_logprobs) == 5
        assert t.top_logprobs[0][0] == t.id                         # greedy = the best one
        assert sum(np.exp(lp) for _, lp in t.top_logprobs) <= 1.0 + 1e-6


def test_prefix_reuse_gives_the_same_answer_and_reports_cached_tokens(default_model, chat_prompt):
    seq = Sequence(default_model)
    p = SamplingParams(temperature=0, max_tokens=8)
    first = list(seq.generate(chat_prompt, p))
    again = list(seq.generate(chat_prompt, p))
    assert [e.id for e in first if isinstance(e, Token)] == [e.id for e in again if isinstance(e, Token)]
    assert isinstance(again[-1], Finish) and again[-1].cached_tokens == len(chat_prompt) - 1


def test_context_overflow_is_a_clear_error(default_model):
    seq = Sequence(default_model, n_ctx=16)
    with pytest.raises(ContextLengthError, match="context holds 16"):
        list(seq.generate(list(range(10)), SamplingParams(max_tokens=10)))


def test_cancel_stops_between_tokens(default_model, chat_prompt):
    seen = []
    events = []
    for ev in Sequence(default_model).generate(chat_prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                                              cancelled=lambda: len(seen) >= 3):
        events.append(ev)
        if isinstance(ev, Token):
            seen.append(ev.id)
    assert events[-1].reason == "cancelled" and events[-1].completion_tokens == 3


def test_top_k_candidates_are_the_stable_sort_prefix_ties_included():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 3000))
        logits = (rng.integers(-4, 4, n) if trial % 2 else rng.standard_normal(n)).astype(np.float32)
        k = int(rng.integers(1, n + 1))
        assert np.array_equal(top_ranked(logits, k), np.argsort(-logits, kind="stable")[:k]), (n, k)
