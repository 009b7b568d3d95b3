"""truncation "auto" (workers/context_fit.py) with a plan whose length is its messages' words:
turns go whole and oldest first, system messages stay, the fewest are dropped, and what cannot
fit even so is the clear error."""

from types import SimpleNamespace

import pytest

from kiln.workers.context_fit import answer_room, fit_turns
from kiln.workers.worker import OpError


def plan_of(body):
    words = sum(len(str(m.get("content") or "").split()) + 2 for m in body["messages"])
    if words > 1000:                       # what the byte bound proves too long before tokenizing
        raise OpError("context_length_exceeded", "the prompt has at least 1000 tokens")
    return SimpleNamespace(prompt=[0] * words, messages=body["messages"])


def conversation(turns: int, words: int = 8) -> list[dict]:
    out = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        out.append({"role": "user", "content": " ".join([f"q{i}"] * words)})
        if i % 3 == 1:                      # a tool call and its result inside the turn
            out.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}"}]})
            out.append({"role": "tool", "tool_call_id": f"c{i}", "content": "result"})
        out.append({"role": "assistant", "content": " ".join([f"a{i}"] * words)})
    return out


def test_the_fewest_oldest_turns_go_whole_and_the_system_message_stays():
    msgs = conversation(12)
    full = len(plan_of({"messages": msgs}).prompt)
    plan, dropped = fit_turns({"messages": msgs}, plan_of, n_ctx=full // 2, room=10)
    kept = plan.messages
    assert kept[0] == msgs[0] and kept[1:] == msgs[1 + dropped:] and kept[1]["role"] == "user"
    assert len(plan.prompt) + 10 <= full // 2
    # one turn fewer dropped would not fit: the fewest were dropped
    prev_start = max(i for i in range(1, 1 + dropped) if msgs[i]["role"] == "user")
    assert len(plan_of({"messages": [msgs[0]] + msgs[prev_start:]}).prompt) + 10 > full // 2
    # nothing to drop when it fits
    assert fit_turns({"messages": msgs}, plan_of, n_ctx=full + 10, room=10)[1] == 0


def test_a_tool_result_is_never_kept_without_its_call():
    msgs = conversation(12)
    for n_ctx in range(60, 400, 7):
        try:
            plan, dropped = fit_turns({"messages": msgs}, plan_of, n_ctx=n_ctx, room=4)
        except OpError:
            continue
        kept = plan.messages[1:]
        assert kept[0]["role"] == "user", n_ctx
        calls = {c["id"] for m in kept for c in m.get("tool_calls") or []}
        assert all(m["tool_call_id"] in calls for m in kept if m["role"] == "tool"), n_ctx


def test_a_conversation_the_byte_bound_refuses_is_cut_until_it_passes():
    msgs = conversation(40, words=30)                    # ~2,600 words: the bound refuses the whole
    plan, dropped = fit_turns({"messages": msgs}, plan_of, n_ctx=900, room=16)
    assert dropped > 0 and len(plan.prompt) + 16 <= 900


def test_when_the_last_turn_alone_does_not_fit_it_is_the_context_error():
    msgs = conversation(3, words=200)
    with pytest.raises(OpError) as e:
        fit_turns({"messages": msgs}, plan_of, n_ctx=300, room=16)
    assert e.value.code == "context_length_exceeded" and "last turn" in e.value.message


def test_the_answer_room_is_max_tokens_or_a_quarter_of_the_context():
    assert answer_room(64, 4096) == 64
    assert answer_room(-1, 4096) == answer_room(None, 4096) == 1024
