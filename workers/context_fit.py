"""`truncation: "auto"`: a conversation longer than the context keeps its system messages and its
latest turns. Turns are dropped whole, oldest first — a turn begins at a user message, so an
assistant's tool calls keep their results — until the prompt and the room for the answer fit.
Opt-in (the Responses API's `truncation`, the same field on chat completions, Ollama's
`truncate`); without it a prompt that does not fit is the clear 400 it always was."""

from __future__ import annotations

from typing import Callable

from .worker import OpError

SYSTEM_ROLES = ("system", "developer")


def answer_room(max_tokens, n_ctx: int) -> int:
    """The tokens to keep free for the answer: max_tokens when the request gives it, else a
    quarter of the context (-1 means "until the context ends", which would leave none)."""
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        return max_tokens
    return max(1, n_ctx // 4)


def fit_turns(body: dict, plan_of: Callable[[dict], object], n_ctx: int, room: int) -> tuple[object, int]:
    """The plan of `body` with the fewest oldest turns dropped that leaves `room` tokens free,
    and how many messages were dropped. `plan_of` may raise OpError context_length_exceeded for a
    text that is provably too long: that candidate does not fit."""
    messages = body["messages"]
    head = 0
    while head < len(messages) and isinstance(messages[head], dict) and messages[head].get("role") in SYSTEM_ROLES:
        head += 1
    rest = messages[head:]
    # where the kept part may begin: the start, or a user message (the last one is kept at least)
    starts = [0] + [i for i, m in enumerate(rest) if i and isinstance(m, dict) and m.get("role") == "user"]

    def attempt(k: int):
        try:
            plan = plan_of({**body, "messages": messages[:head] + rest[starts[k]:]})
        except OpError as e:
            if e.code != "context_length_exceeded":
                raise
            return None
        return plan if len(plan.prompt) + room <= n_ctx else None

    # the prompt shrinks as more turns go: the fewest dropped that fit, by bisection
    lo, hi, best = 0, len(starts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = attempt(mid)
        if plan is not None:
            best, hi = (plan, mid), mid - 1
        else:
            lo = mid + 1
    if best is None:
        raise OpError("context_length_exceeded",
                      f"with truncation the system messages and the last turn are kept, and they leave no room for "
                      f"{room} tokens of answer in the context of {n_ctx}: shorten them or ask for fewer tokens")
    plan, k = best
    return plan, starts[k]
