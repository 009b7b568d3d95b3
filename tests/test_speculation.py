"""Prompt-lookup speculation and chunked prefill change no answer (fast tier, the default model
in-process): greedy and seeded sampling give the same tokens with drafting on and off, a long
prompt prefilled in chunks between another request's decode steps gives the same tokens as
alone, and the draft proposer and its controller behave."""

import threading

import pytest

from kiln.native.generate import Finish, Token
from kiln.native.sampling import SamplingParams
from kiln.native.scheduler import Scheduler
from kiln.native.speculate import DraftControl, propose

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


@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}, {"temperature": 1.0, "seed": 9}])
def test_drafting_changes_no_token(default_model, kw):
    prompt = _chat(default_model, f"Rewrite this code, renaming width to w and changing nothing else:\n\n{CODE}")
    out = {}
    for spec in (False, True):
        s = Scheduler(default_model, 2048, 1, speculative=spec)
        out[spec] = _collect(s.submit(prompt, SamplingParams(max_tokens=96, **kw), lambda: False))
    assert out[True][0] == out[False][0]
    assert out[True][1].drafted > 0, "the repetitive task should have drafted"
    assert out[False][1].drafted == 0


def test_a_prompt_prefilled_between_decode_steps_gives_the_same_tokens(default_model):
    tok = default_model.tokenizer
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


def test_propose_finds_the_latest_earlier_occurrence():
    h = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert propose(h, 3) == [4, 5, 9]
    assert propose([1, 2, 3], 4) == []
    assert propose([5, 6, 7, 8, 5, 6], 2) == [7, 8]
    assert propose(h, 0) == []


def test_draft_control_grows_on_success_and_pauses_when_it_does_not_pay():
    c = DraftControl(k=4)
    c.update(4, 4, 0.02, 4, plain_step=0.016)
    assert c.k == 8 and c.want() == 8
    c.update(8, 0, 0.06, 1, plain_step=0.016)             # 60 ms for one token: slower than plain
    assert c.want() == 0 and c.cooldown > 0
