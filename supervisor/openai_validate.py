"""Validation of OpenAI-style request bodies: pure functions from a JSON body to the sampling
parameters and work items a worker takes, raising a 400 that names the field. No daemon, no
socket — tested on their own (tests/test_openai_validation.py)."""

from __future__ import annotations

import json
from typing import Any

from .http_common import JSONError

_ROLES = ("system", "user", "assistant", "tool", "developer")


def bad(param: str, message: str, code: str = "invalid_value") -> JSONError:
    return JSONError(400, code, message, param=param)


# -- request validation ------------------------------------------------------------------------

def _number(body: dict, name: str, low: float, high: float, kind=(int, float)):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, kind):
        raise bad(name, f"{name} must be a {'integer' if kind is int else 'number'}, got {json.dumps(v)[:40]}",
                  "invalid_type")
    if not low <= v <= high:
        raise bad(name, f"{name} = {v} is out of range [{low}, {high}]")
    return v


def sampling_params(body: dict, min_tokens: int = 1) -> dict:
    p: dict[str, Any] = {}
    for name, low, high, kind in (("temperature", 0, 2, (int, float)), ("top_p", 0, 1, (int, float)),
                                  ("top_k", 0, 1 << 20, int), ("min_p", 0, 1, (int, float)),
                                  ("presence_penalty", -2, 2, (int, float)),
                                  ("frequency_penalty", -2, 2, (int, float)),
                                  ("repeat_penalty", 0.01, 10, (int, float)), ("seed", -(2**63), 2**64 - 1, int)):
        v = _number(body, name, low, high, kind)
        if v is not None:
            p[name] = float(v) if kind != int else v
    if p.get("top_p") == 0:
        raise bad("top_p", "top_p must be greater than 0")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        which = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        _number({which: mt}, which, min_tokens, 1 << 30, int)
        p["max_tokens"] = mt
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
            raise bad("stop", "stop must be a non-empty string or a list of up to 16 non-empty strings")
        p["stop"] = stops
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise bad("ignore_eos", "ignore_eos must be a boolean", "invalid_type")
        p["ignore_eos"] = body["ignore_eos"]
    n = body.get("n", 1)
    if n != 1:
        raise bad("n", f"n = {json.dumps(n)[:20]} is not supported: Kiln returns one choice (n = 1)")
    if "seed" in p:
        p["seed"] = p["seed"] % (2**63)
    return p


def logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad("logprobs", "logprobs must be a boolean", "invalid_type")
        top = _number(body, "top_logprobs", 0, 20, int)
        if top is not None and not lp:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return (top or 0) if lp else None
    return _number(body, "logprobs", 0, 20, int)


def adapter(body: dict) -> dict:
    """Kiln's extension: "adapter": a registered LoRA for this request ("" for none; absent:
    the active adapter, if one is loaded)."""
    if body.get("adapter") is None:
        return {}
    if not isinstance(body["adapter"], str):
        raise bad("adapter", "adapter must be a string (an adapter name, or \"\" for none)", "invalid_type")
    return {"adapter": body["adapter"]}


def messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list", "invalid_value" if isinstance(msgs, list) else "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object", "invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role", f"role must be one of {', '.join(_ROLES)}, got {json.dumps(role)[:30]}")
        content = m.get("content")
        if isinstance(content, list):       # [{"type": "text", "text": ...}]
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"messages[{i}].content[{j}]", "only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "content must be a string or a list of text parts", "invalid_type")
        out.append({"role": role, "content": content})
    return out


def prompts(body: dict) -> list[dict]:
    """A completions prompt — a string, token ids, or a batch of either — as work items."""
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and bool(p) and all(  # noqa: E731
        isinstance(t, int) and not isinstance(t, bool) for t in p)
    batch = prompt if isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or is_ids(p) for p in prompt) and not is_ids(prompt) else [prompt]
    works = []
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad(where, "prompt is empty")
            works.append({"text": p, "special": True})
        elif is_ids(p):
            works.append({"prompt": p})
        else:
            raise bad(where, "prompt must be a non-empty string, a list of token ids, or a list of those",
                      "invalid_type")
    if len(works) > 64:
        raise bad("prompt", f"at most 64 prompts per request, got {len(works)}")
    return works
