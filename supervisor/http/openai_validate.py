"""Validation of OpenAI-style request bodies: pure functions from a JSON body to the sampling
parameters and work items a worker takes, raising a 400 that names the field. No daemon, no
socket — tested on their own (tests/test_openai_validation.py)."""

from __future__ import annotations

import math

import json
import re
from typing import Any

from kiln.protocol.sampling import BOUNDS

from .images import no_mark, url_image
from .common import JSONError

_ROLES = ("system", "user", "assistant", "tool", "developer")

_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty",
             "seed", "max_tokens", "max_completion_tokens", "stop", "ignore_eos", "n", "logit_bias", "typical_p"}
_COMMON = {"model", "stream", "stream_options", "adapter", "adapter_scale", "keep_alive", "speculative", "context_shift"} | _SAMPLING
# grammar (GBNF) and json_schema: llama-server's, on its OpenAI-style routes too
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                         "response_format", "chat_template_kwargs", "reasoning_effort", "grammar", "json_schema",
                         "truncation"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "logprobs", "suffix", "grammar", "json_schema"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "keep_alive", "adapter"}
# accepted and ignored: they change nothing a local server computes
IGNORED = {"user", "metadata", "store", "service_tier"}
# OpenAI fields Kiln does not implement, and what to do instead
_REFUSED = {"functions": "use tools", "function_call": "use tool_choice", "best_of": "use n",
            "audio": "Kiln serves text models",
            "modalities": "Kiln serves text models", "prediction": "predicted outputs are not supported",
            "web_search_options": "Kiln has no web search"}
MAX_STOPS = 64                  # native/sampling.py's (tests/test_openai_validation.py holds them equal)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
EFFORTS = ("low", "medium", "high")


def known_fields(body: dict, allowed: set[str]) -> None:
    """400 naming the first field Kiln would otherwise have to ignore."""
    for k in body:
        if k in allowed or k in IGNORED:
            continue
        why = _REFUSED.get(k, "Kiln does not implement it")
        raise bad(k, f"unsupported field {k!r}: {why}. Supported: {', '.join(sorted(allowed))}",
                  "unsupported_field")


def bad(param: str, message: str, code: str = "invalid_value") -> JSONError:
    return JSONError(400, code, message, param=param)


# -- request validation ------------------------------------------------------------------------

def number(body: dict, name: str, low: float, high: float, kind=(int, float)):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, kind):
        raise bad(name, f"{name} must be a {'integer' if kind is int else 'number'}, got {json.dumps(v)[:40]}",
                  "invalid_type")
    if not low <= v <= high:
        raise bad(name, f"{name} = {v} is out of range [{low}, {high}]")
    return v


def sampling_params(body: dict, min_tokens: int = 1, unbounded: bool = False) -> dict:
    """`unbounded`: max_tokens -1 (llama-server's "until the model stops or the context ends")
    is accepted — what leaving it out means on the routes that say so."""
    p: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repeat_penalty", "seed"):
        kinds, low, high = BOUNDS[name]
        kind = int if kinds == (int,) else (int, float)
        v = number(body, name, low, high, kind)
        if v is not None:
            p[name] = float(v) if kind != int else v
    if p.get("top_p") == 0:
        raise bad("top_p", "top_p must be greater than 0")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt == -1 and unbounded and not isinstance(mt, bool):
        p["max_tokens"] = -1
    elif mt is not None:
        which = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        number({which: mt}, which, min_tokens, BOUNDS["max_tokens"][2], int)
        p["max_tokens"] = mt
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
            raise bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOPS} non-empty strings")
        p["stop"] = stops
    if body.get("speculative") is not None:      # Kiln's extension: prompt-lookup drafting on/off
        if not isinstance(body["speculative"], bool):
            raise bad("speculative", "speculative must be a boolean", "invalid_type")
        p["speculative"] = body["speculative"]
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise bad("ignore_eos", "ignore_eos must be a boolean", "invalid_type")
        p["ignore_eos"] = body["ignore_eos"]
    p.update(context_shift(body))
    n = number(body, "n", *BOUNDS["n"][1:], int)
    if n is not None and n > 1:
        p["n"] = n
    tp = number(body, "typical_p", *BOUNDS["typical_p"][1:])
    if tp is not None:
        if tp == 0:
            raise bad("typical_p", "typical_p must be greater than 0")
        p["typical_p"] = float(tp)
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise bad("logit_bias", "logit_bias must be an object mapping token ids to biases", "invalid_type")
        pairs = []
        for k, v in lb.items():
            if not (isinstance(k, str) and k.isdigit()):
                raise bad("logit_bias", f"logit_bias key {k!r} is not a token id")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise bad("logit_bias", f"logit_bias[{k}] = {json.dumps(v)[:20]} must be a number in [-100, 100]")
            pairs.append([int(k), float(v)])
        p["logit_bias"] = pairs
    if "seed" in p:
        p["seed"] = p["seed"] % (2**63)
    return p


def context_shift(body: dict) -> dict:
    """Kiln's `context_shift` (llama-server's --context-shift, per request; Ollama's `shift`): an
    answer that reaches the context's end drops the older half of what follows the first n_keep
    tokens and goes on (native/generate.py shift_plan); false: it stops there ("length"), whatever
    the worker's context_shift setting says. n_keep / n_discard: llama-server's, where a dialect
    admits them."""
    p: dict[str, Any] = {}
    if body.get("context_shift") is not None:
        if not isinstance(body["context_shift"], bool):
            raise bad("context_shift", "context_shift must be a boolean", "invalid_type")
        p["context_shift"] = body["context_shift"]
    for name in ("n_keep", "n_discard"):
        v = number(body, name, *BOUNDS[name][1:], int)
        if v is not None:
            p[name] = v
    return p


def _check_schema(schema, where: str) -> None:
    if not isinstance(schema, dict):
        raise bad(where, f"{where} must be a JSON schema object", "invalid_type")
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a dependency
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise bad(where, f"{where} is not a valid JSON schema: {e.message}", "invalid_schema") from None


def tools(body: dict) -> dict:
    """tools, tool_choice, parallel_tool_calls, response_format, chat_template_kwargs and
    reasoning_effort, checked for shape (what needs the model — its template, whether a
    grammar compiles — the worker checks)."""
    out: dict[str, Any] = {}
    ts = body.get("tools")
    if ts is not None:
        if not isinstance(ts, list):
            raise bad("tools", "tools must be a list of functions", "invalid_type")
        names = set()
        for i, t in enumerate(ts):
            where = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
                raise bad(where, f'{where} must be {{"type": "function", "function": {{"name": …}}}}')
            f = t["function"]
            if not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
                raise bad(f"{where}.function.name", "a function name is 1-64 letters, digits, _ . or -")
            if f["name"] in names:
                raise bad(f"{where}.function.name", f"two tools are named {f['name']!r}")
            names.add(f["name"])
            for k in f:
                if k not in ("name", "description", "parameters", "strict"):
                    raise bad(f"{where}.function.{k}", f"unsupported field {k!r} in a function")
            if "parameters" in f:
                _check_schema(f["parameters"], f"{where}.function.parameters")
        if ts:
            out["tools"] = ts
    choice = body.get("tool_choice")
    if choice is not None:
        if not out.get("tools") and choice != "none":
            raise bad("tool_choice", "tool_choice needs tools")
        named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)
        if choice not in ("none", "auto", "required") and not named:
            raise bad("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                     '{"type": "function", "function": {"name": …}}')
        if named and choice["function"]["name"] not in {t["function"]["name"] for t in out["tools"]}:
            raise bad("tool_choice", f"tool_choice names {choice['function']['name']!r}, which is not in tools")
        out["tool_choice"] = choice
    ptc = body.get("parallel_tool_calls")
    if ptc is not None:
        if not isinstance(ptc, bool):
            raise bad("parallel_tool_calls", "parallel_tool_calls must be a boolean", "invalid_type")
        out["parallel_tool_calls"] = ptc
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise bad("response_format", 'response_format.type must be "text", "json_object" or "json_schema"')
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("name"), str):
                raise bad("response_format.json_schema", "json_schema must be an object with a name and a schema")
            _check_schema(js.get("schema", {}), "response_format.json_schema.schema")
        out["response_format"] = rf
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("chat_template_kwargs", "chat_template_kwargs must be an object", "invalid_type")
        out["chat_template_kwargs"] = kw
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad("reasoning_effort", f"reasoning_effort must be one of {', '.join(EFFORTS)}")
        out["reasoning_effort"] = effort
    return out


def tools_named(body: dict, renames: tuple[tuple[str, str], ...]) -> dict:
    """`tools(body)` for a chat body translated from another API: a refusal names that API's
    field (`renames`: chat name -> its name, in the param and the message)."""
    try:
        return tools(body)
    except JSONError as e:
        err = e.kiln_body["error"]
        param, message = str(err.get("param") or ""), err["message"]
        for chat_name, name in renames:
            param, message = param.replace(chat_name, name), message.replace(chat_name, name)
        raise bad(param, message, err.get("code") or "invalid_value") from None


def grammar(body: dict) -> dict:
    """llama-server's `grammar` (GBNF text) or `json_schema`, as the generate op's `grammar`; the
    worker compiles it (a grammar that does not is a 400 saying why)."""
    g, js = body.get("grammar"), body.get("json_schema")
    if g is not None and js is not None:
        raise bad("json_schema", "give grammar or json_schema, not both")
    for other in ("response_format", "tool_choice"):
        if (g is not None or js is not None) and body.get(other) not in (None, "auto", "none") and \
                not (other == "response_format" and (body[other] or {}).get("type") == "text"):
            raise bad("grammar" if g is not None else "json_schema",
                      f"{'grammar' if g is not None else 'json_schema'} cannot be combined with {other}: "
                      f"each constrains the answer; give one")
    if g is not None:
        if not isinstance(g, str) or not g.strip():
            raise bad("grammar", "grammar must be a GBNF grammar (root ::= …)", "invalid_type")
        return {"grammar": {"gbnf": g}}
    if js is not None:
        if not isinstance(js, dict):
            raise bad("json_schema", "json_schema must be a JSON schema object", "invalid_type")
        return {"grammar": {"json_schema": js}}
    return {}


def logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad("logprobs", "logprobs must be a boolean", "invalid_type")
        top = number(body, "top_logprobs", 0, 20, int)
        if top is not None and not lp:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return (top or 0) if lp else None
    return number(body, "logprobs", 0, 20, int)


def keep_alive(body: dict) -> dict:
    """Kiln's (and Ollama's) extension: how long the model stays loaded after this request."""
    if body.get("keep_alive") is None:
        return {}
    from ..core.units import parse_duration
    try:
        parse_duration(body["keep_alive"])
    except ValueError as e:
        raise bad("keep_alive", str(e)) from None
    return {"keep_alive": body["keep_alive"]}


def truncation(body: dict) -> dict:
    """The Responses API's `truncation`, taken on chat completions too: "auto" drops the oldest
    turns (after the system messages) until the prompt and max_tokens fit; "disabled", the
    default, refuses a prompt that does not fit (workers/context_fit.py)."""
    t = body.get("truncation")
    if t in (None, "disabled"):
        return {}
    if t != "auto":
        raise bad("truncation", 'truncation must be "auto" (drop the oldest turns to fit the context) or "disabled"')
    return {"truncation": "auto"}


MAX_ADAPTER_SCALE = 8.0


def adapter(body: dict) -> dict:
    """Kiln's extension: "adapter": a registered LoRA for this request ("" for none; absent:
    the active adapter, if one is loaded), and "adapter_scale": how strongly it applies (1: as
    trained; 0.5 half, 0 not at all — llama-server's per-request `lora` scale)."""
    out = {}
    if body.get("adapter") is not None:
        if not isinstance(body["adapter"], str):
            raise bad("adapter", "adapter must be a string (an adapter name, or \"\" for none)", "invalid_type")
        out["adapter"] = body["adapter"]
    s = body.get("adapter_scale")
    if s is not None:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise bad("adapter_scale", "adapter_scale must be a number", "invalid_type")
        if abs(s) > MAX_ADAPTER_SCALE:
            raise bad("adapter_scale", f"adapter_scale {s} is out of range: -{MAX_ADAPTER_SCALE:g} to {MAX_ADAPTER_SCALE:g}")
        if not out.get("adapter"):
            raise bad("adapter_scale", "adapter_scale scales an adapter: name one in `adapter`")
        out["adapter_scale"] = float(s)
    return out


def messages(body: dict, images=None) -> list[dict]:
    """The chat's messages, checked; `images` (supervisor/http/images.py Images): where image
    parts go (a mark in the content, the bytes kept in order) — None: this route takes none."""
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
        if isinstance(content, list):       # [{"type": "text", "text": ...}, {"type": "image_url", ...}]
            content = "".join(_part(part, f"messages[{i}].content[{j}]", images) for j, part in enumerate(content))
        elif isinstance(content, str) and images is not None:
            no_mark(content, f"messages[{i}].content")
        msg: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls")
        if calls is not None and role == "assistant":
            msg["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        if content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", "content must be a string or a list of text parts", "invalid_type")
        msg["content"] = content
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None:
                if not isinstance(m[k], str):
                    raise bad(f"messages[{i}].{k}", f"{k} must be a string", "invalid_type")
                msg[k] = m[k]
        for k, v in m.items():
            if k not in msg and k not in ("tool_calls", "role", "content") and v not in (None, [], "", {}):
                if k == "reasoning_content":
                    continue                  # a previous answer's reasoning: templates drop it
                raise bad(f"messages[{i}].{k}", f"unsupported message field {k!r}")
        out.append(msg)
    return out


def _part(part, where: str, images) -> str:
    """A content part's text: its own, or an image's mark (its bytes kept in `images`)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"] if images is None else no_mark(part["text"], where + ".text")
    if kind == "image_url":
        if images is None:
            raise bad(where, "this endpoint takes no images")
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        return images.add(url_image(url, where + ".image_url.url", images.fetch), where)
    raise bad(where, "a content part must be {\"type\": \"text\", \"text\": …} or {\"type\": \"image_url\", "
                     "\"image_url\": {\"url\": \"data:image/png;base64,…\"}}")


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(where, "tool_calls must be a list", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                and isinstance(f.get("arguments", "{}"), (str, dict))):
            raise bad(f"{where}[{j}]", 'a tool call is {"id": …, "type": "function", "function": '
                                       '{"name": …, "arguments": "<JSON>"}}')
        out.append({"id": str(c.get("id") or f"call_{j}"), "type": "function",
                    "function": {"name": f["name"], "arguments": f.get("arguments", "{}")}})
    return out
