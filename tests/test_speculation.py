"""Prompt-lookup speculation and chunked prefill change no answer (fast tier, the default model
in-process): greedy and seeded sampling give the same tokens with drafting on and off, a long
prompt prefilled in chunks between another request's decode steps gives the same tokens as
alone, and the draft proposer and its controller behave."""

import threading

import pytest

from kiln.native.generate import Finish, Token
from kiln.native.sampling import SamplingParams
from kiln.native.scheduler import Scheduler
from kiln.native.speculate import GUESS_PER_ROW, PROBE_EVERY, DraftControl, ForwardCosts, propose

CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Return the perimeter of a rectangle."""
    return 2 * (width + height)
'''


def _chat(model, text):
    from kiln.native.chat_template import render_and_tokenize, template_for
    return render_and_tokenize(template_for(model), model.tokenizer, [{"role": "user", "content": text}])[1]


def _collect(job):
    ids, fin = [], None
    while fin is None:
        ev = job.events.get(timeout=120)
        if isinstance(ev, Token):
            ids.append(ev.id)
        elif isinstance(ev, Finish):
            fin = ev
        else:
            raise ev
    return ids, fin


# greedy in the fast tier; the sampled ones (the rejection path) with the whole suite
@pytest.mark.parametrize("kw", [{"temperature": 0}, pytest.param({"temperature": 0.8, "seed": 5}, marks=pytest.mark.slow),
                                pytest.param({"temperature": 1.0, "seed": 9}, marks=pytest.mark.slow)])
def test_drafting_changes_no_token(default_model, kw):
    prompt = _chat(default_model, f"Rewrite this code, renaming width to w and changing nothing else:\n\n{CODE}")
    out = {}
    for spec in (False, True):
        s = Scheduler(default_model, 2048, 1, speculative=spec)
        out[spec] = _collect(s.submit(prompt, SamplingParams(max_tokens=96, **kw), lambda: False))
    assert out[True][0] == out[False][0]
    assert out[True][1].drafted > 0, "the repetitive task should have drafted"
    assert out[False][1].drafted == 0


@pytest.mark.slow
def test_a_prompt_prefilled_between_decode_steps_gives_the_same_tokens(default_model):
    long_prompt = _chat(default_model, "Summarise: " + CODE * 4)
    short = _chat(default_model, "Count to twenty.")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = {}
    for name, p in (("long", long_prompt), ("short", short)):
        alone[name] = _collect(Scheduler(default_model, 2048, 2, speculative=False).submit(p, params, lambda: False))[0]
    s = Scheduler(default_model, 2048, 2, prefill_chunk=8, speculative=False)
    first = s.submit(short, params, lambda: False)
    got = {}
    started = threading.Event()

    def read_short():
        ids = []
        while True:
            ev = first.events.get(timeout=120)
            if isinstance(ev, Token):
                ids.append(ev.id)
                if len(ids) == 3:
                    started.set()
            elif isinstance(ev, Finish):
                got["short"] = ids
                return
    t = threading.Thread(target=read_short)
    t.start()
    assert started.wait(60)
    got["long"] = _collect(s.submit(long_prompt, params, lambda: False))[0]
    t.join(120)
    assert len(long_prompt) > 8 * 10                      # it really was prefilled in many chunks
    assert got == alone


@pytest.mark.slow
def test_a_prompt_whose_chunks_ride_in_the_decode_steps_gives_the_same_tokens(default_model):
    """The default scheduling: a prompt arriving mid-stream runs chunk by chunk in the stream's
    decode forwards — both requests' tokens are what each gives alone."""
    long_prompt = _chat(default_model, "Summarise: " + CODE * 3)
    short = _chat(default_model, "Count to twenty.")
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    alone = {name: _collect(Scheduler(default_model, 2048, 2, speculative=False).submit(p, params, lambda: False))[0]
             for name, p in (("long", long_prompt), ("short", short))}
    s = Scheduler(default_model, 2048, 2, speculative=False)
    first = s.submit(short, params, lambda: False)
    ev = first.events.get(timeout=120)                     # the stream is under way
    assert isinstance(ev, Token)
    second = s.submit(long_prompt, params, lambda: False)
    got_short = [ev.id] + _collect(first)[0]
    assert _collect(second)[0] == alone["long"] and got_short == alone["short"]
    assert s.load()["prefill_rides"] >= 3                 # it was prefilled riding, in several chunks


def test_propose_finds_the_latest_earlier_occurrence_or_the_next_along_the_source():
    h = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert propose(h, 3) == ([4, 5, 9], 3, 3)              # (tokens, where they begin, match length)
    assert propose([1, 2, 3], 4)[:2] == ([], None)
    assert propose([5, 6, 7, 8, 5, 6], 2) == ([7, 8], 2, 2)
    assert propose(h, 0)[:2] == ([], None)
    # a source with two similar lines; the copy got past the first: the second one is next
    src = [7, 1, 2, 3, 0, 8, 1, 2, 4, 0]
    copied = src + [9, 1, 2, 3, 0, 5, 1, 2]                 # strayed at 9 and 5
    assert propose(copied, 2)[:2] == ([3, 0], 13)           # the latest: the copy's own first line
    assert propose(copied, 2, cursor=5)[:2] == ([4, 0], 8)  # along the source: its second line
    assert propose(list(range(10)) * 500 + [3, 4], 2, cursor=4000)[1] == 4005   # past the window: absolute


def _costs(**ratios):
    c = ForwardCosts()
    for _ in range(3):
        c.record(1, 0.010)
        for rows, r in ratios.items():
            c.record(int(rows[1:]), 0.010 * r)
    return c


def test_draft_control_checks_more_of_a_draft_as_it_is_kept_and_cheap():
    c = DraftControl()
    cheap = _costs(r2=1.2, r3=1.35, r4=1.5, r5=1.65, r6=1.8, r7=1.95, r8=2.1, r9=2.25)
    first = c.choose(16, cheap)
    assert 1 <= first < 8
    for _ in range(30):
        c.update(first, first)
    assert c.p0 > 0.95 and (first == 1 or c.p1 > 0.95)
    c.update(4, 4)
    assert c.p1 > 0.9
    assert c.choose(16, cheap) > first                    # kept every time: check more
    assert c.choose(2, cheap) == 2                        # never more than was proposed
    dear = _costs(r2=2.1, r3=3.2, r4=4.3)                 # a row costs more than a step
    assert c.choose(16, dear) == 0


def test_the_first_token_is_judged_per_match_length():
    c = DraftControl()
    costs = _costs(r2=1.3, r3=1.6, r4=1.9)
    c.choose(16, costs, match=2)
    for _ in range(10):
        c.update(2, 0)                                    # two-token matches: never kept
    c.choose(16, costs, match=4)
    for _ in range(10):
        c.update(3, 3)                                    # four-token matches: always
    assert c.choose(16, costs, match=2) == 0
    assert c.choose(16, costs, match=4) >= 2


def test_draft_control_stops_when_drafts_are_not_kept_and_probes_later():
    c = DraftControl()
    costs = _costs(r2=1.3, r3=1.6)
    for _ in range(20):
        c.update(2, 0)
    assert c.p0 < 0.2
    picks = [c.choose(16, costs) for _ in range(PROBE_EVERY)]
    assert picks[:-1] == [0] * (PROBE_EVERY - 1) and picks[-1] == 1     # a one-token probe
    assert DraftControl().choose(16, ForwardCosts()) == 0                # nothing measured yet


def test_forward_costs_take_the_median_and_try_a_size_before_judging_it():
    c = ForwardCosts()
    assert c.ratio(2) is None
    for s in (0.010, 0.011, 0.050, 0.010, 0.012):
        c.record(1, s)
    assert c.seconds(1) == 0.011                          # one stall does not move it
    c.record(3, 0.200)                                    # one slow sample of an untried size
    assert c.ratio(3) == pytest.approx(1 + 2 * GUESS_PER_ROW)
    c.record(3, 0.200)
    c.record(3, 0.200)
    assert c.ratio(3) == pytest.approx(0.2 / 0.011)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}])
def test_a_draft_model_changes_no_token(default_model, kw):
    """The default model drafts for itself, four tokens a step (draft_min; on its own the
    controller would not draft with a model as costly as the served one): greedy keeps nearly
    every draft token, sampling rejects some — and the text is plain decoding's either way."""
    from kiln.native.draft_model import DraftModel
    draft = DraftModel(default_model, default_model)
    prompt = _chat(default_model, "Write a haiku about the sea.")
    params = SamplingParams(max_tokens=36, ignore_eos=True, **kw)
    plain = _collect(Scheduler(default_model, 2048, 1, speculative=False).submit(prompt, params, lambda: False))
    s = Scheduler(default_model, 2048, 1, draft_model=draft, draft_min=4)
    ids, fin = _collect(s.submit(prompt, params, lambda: False))
    assert ids == plain[0]
    assert fin.drafted >= 4 * 6
    if kw["temperature"] == 0:
        assert fin.accepted >= fin.drafted - 4           # at most the last draft cut by max_tokens
    else:
        assert 0 < fin.accepted < fin.drafted
    # the draft cache follows the text: a second request on the same scheduler is still exact
    again, _ = _collect(s.submit(prompt, params, lambda: False))
    assert again == plain[0]


def test_a_draft_model_with_another_vocabulary_is_refused(default_model):
    from conftest import tiny_path
    from kiln.native.draft_model import DraftModel, DraftModelError
    from kiln.native.model import load_model
    with pytest.raises(DraftModelError, match="vocabularies differ"):
        DraftModel(load_model(tiny_path("qwen3")), default_model)


def test_a_request_starts_from_what_drafts_kept_lately_then_follows_its_own_text():
    shared = DraftControl()
    costs = _costs(r2=1.2, r3=1.35, r4=1.5, r5=1.65, r6=1.8, r7=1.95, r8=2.1, r9=2.25)
    first_ever = DraftControl(prior=shared).choose(16, costs, match=4)
    earlier = DraftControl(prior=shared)
    earlier.choose(16, costs, match=4)
    for _ in range(20):
        earlier.update(6, 6)                              # an earlier request: every draft kept
    assert shared.p1 > 0.9 and shared.drafted == 120
    later = DraftControl(prior=shared)
    assert later.choose(16, costs, match=4) > first_ever   # starts confident, not at "half kept"
    for _ in range(6):
        later.update(4, 0)                                # its own text: nothing kept
    assert later.p0 < 0.35                                # the prior weighs only a few drafts


def test_a_fault_in_the_scheduler_ends_the_requests_under_way_and_it_goes_on(default_model):
    """A bug outside the forwards (here: drafting raises) must not kill the scheduler thread,
    which would leave every request waiting for ever: the request gets the error, its slot is
    freed and its cache forgotten, and the next request is served."""
    s = Scheduler(default_model, 2048, 1)
    prompt = _chat(default_model, f"Rewrite this code, renaming width to w and changing nothing else:\n\n{CODE}")
    params = SamplingParams(temperature=0, max_tokens=24)

    def broken(*a):
        raise KeyError("a bug")
    s._speculate = broken
    with pytest.raises(RuntimeError, match=r"internal error in the scheduler \(KeyError"):
        _collect(s.submit(prompt, params, lambda: False))
    assert s.free == [0] and s.seqs[0].cache.n == 0 and s.thread.is_alive()
    del s._speculate
    want = _collect(Scheduler(default_model, 2048, 1).submit(prompt, params, lambda: False))[0]
    assert _collect(s.submit(prompt, params, lambda: False))[0] == want


@pytest.mark.slow
def test_a_retry_of_a_cancelled_prefill_reuses_what_was_computed(default_model):
    """A client that gives up during a long prefill (an idle timeout) and retries: the retry
    continues from the chunks already in the slot's cache, and answers as a fresh run does."""
    prompt = _chat(default_model, "Summarise: " + CODE * 12)
    assert len(prompt) > 600                                    # several 256-token chunks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    s = Scheduler(default_model, 2048, 1, speculative=False)
    gave_up = _collect(s.submit(prompt, params, lambda: s.seqs[0].cache.n >= 256))[1]
    assert gave_up.reason == "cancelled" and gave_up.completion_tokens == 0
    ids, fin = _collect(s.submit(prompt, params, lambda: False))
    assert fin.cached_tokens >= 256 and fin.reason == "length"
    assert ids == _collect(Scheduler(default_model, 2048, 1, speculative=False).submit(prompt, params,
                                                                                       lambda: False))[0]
