"""Anthropic's Messages API on Kiln's port: POST /v1/messages and /v1/messages/count_tokens — what
Claude Code and the `anthropic` SDK speak (`ANTHROPIC_BASE_URL=http://127.0.0.1:8420`), as
Ollama and llama-server have it.

A request is translated into the chat work /v1/chat/completions sends — `system` the system
message, text blocks the content, `tool_use` blocks an assistant's tool_calls, `tool_result`
blocks tool messages, `tools` (input_schema) the chat tools, `thinking` the template's
enable_thinking — so it is validated and generated the same way; the answer comes back as
content blocks (thinking, text, tool_use), whole or as Anthropic's stream events. Errors are in
Anthropic's shape ({"type": "error", "error": {"type", "message"}})."""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

from .images import Images, fetching
from .pipeline import Pipeline, Shape, stream_flag
from .openai_validate import adapter, bad, keep_alive, known_fields, messages, sampling_params, tools_named
from .work import Work, model_of

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "thinking", "output_config", "speed", "context_management", "adapter", "adapter_scale", "keep_alive"}
# accepted, changing nothing a local server computes: accounting and placement, and prompt caching
# (Kiln reuses every cached prompt prefix on its own); no diagnostics are returned
IGNORED = {"metadata", "service_tier", "inference_geo", "user_profile_id", "workspace_id", "diagnostics",
           "cache_control"}
EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
# block fields that change nothing here: Kiln reuses every prompt prefix it has cached on its own
_BLOCK_EXTRAS = {"cache_control", "citations"}
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_shape(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _blocks(content, where: str) -> list[dict]:
    """A message's content as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(where, "content must be a string or a list of content blocks", "invalid_type")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad(f"{where}[{j}]", 'a content block is an object with a "type"', "invalid_type")
    return content


def _text(blocks, where: str) -> str:
    out = []
    for j, b in enumerate(_blocks(blocks, where)):
        if b["type"] != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{where}[{j}]", f"only text blocks are supported here, got {b['type']!r}")
        _no_extras(b, {"type", "text"}, f"{where}[{j}]")
        out.append(b["text"])
    return "".join(out)


def _no_extras(block: dict, allowed: set[str], where: str) -> None:
    for k in block:
        if k not in allowed and k not in _BLOCK_EXTRAS:
            raise bad(f"{where}.{k}", f"unsupported field {k!r} in a {block.get('type')} block")


def chat_messages(body: dict) -> list[dict]:
    """`system` and `messages` as chat messages. A user turn's tool_result blocks become tool
    messages (before its text); an assistant turn's tool_use blocks its tool_calls; thinking
    blocks of earlier turns are dropped, as chat templates drop earlier turns' thinking."""
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list",
                  "invalid_value" if isinstance(msgs, list) else "invalid_type")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad(f"{where}.role", "each message is {\"role\": \"user\" | \"assistant\" | \"system\", "
                                       "\"content\": …}")
        if m["role"] == "system":                 # mid-conversation system text (Claude Code sends it)
            out.append({"role": "system", "content": _text(m.get("content"), f"{where}.content")})
            continue
        texts, calls = [], []
        for j, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
            at = f"{where}.content[{j}]"
            kind = b["type"]
            if kind == "text" and isinstance(b.get("text"), str):
                _no_extras(b, {"type", "text"}, at)
                texts.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                _no_extras(b, {"type", "id", "name", "input"}, at)
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                        or not isinstance(b.get("input", {}), dict):
                    raise bad(at, 'a tool_use block is {"type": "tool_use", "id": …, "name": …, "input": {…}}')
                calls.append({"id": b["id"], "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                _no_extras(b, {"type", "tool_use_id", "content", "is_error"}, at)
                if not isinstance(b.get("tool_use_id"), str):
                    raise bad(f"{at}.tool_use_id", "a tool_result needs the tool_use_id it answers", "invalid_type")
                result = _text(b.get("content", ""), f"{at}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"           # the template has no field for it: say it
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue
            elif kind == "image" and m["role"] == "user":
                _no_extras(b, {"type", "source"}, at)
                texts.append(_image_part(b.get("source"), f"{at}.source"))
            elif kind == "document":
                raise bad(at, "document blocks are not supported: send the document's text")
            else:
                raise bad(f"{at}.type", f"a {kind!r} block is not supported in a {m['role']} message")
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts or not any(o["role"] == "tool" for o in out[-1:]):
            parts = [t if isinstance(t, dict) else {"type": "text", "text": t} for t in texts]
            out.append({"role": "user", "content": parts if any(isinstance(t, dict) for t in texts) else "".join(texts)})
    return out


def _image_part(source, where: str) -> dict:
    """An image block's source as a chat image part (its bytes as a data: URI)."""
    if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
        raise bad(where, 'an image source is {"type": "base64", "media_type": "image/png", "data": …}')
    if source["type"] == "url":
        return {"type": "image_url", "image_url": {"url": source.get("url")}}      # refused there, saying why
    kind = source.get("media_type")
    if kind not in ("image/jpeg", "image/png", "image/gif", "image/webp"):
        raise bad(f"{where}.media_type", "media_type must be image/jpeg, image/png, image/gif or image/webp")
    if not isinstance(source.get("data"), str):
        raise bad(f"{where}.data", "data must be the image's bytes in base64", "invalid_type")
    return {"type": "image_url", "image_url": {"url": f"data:{kind};base64,{source['data']}"}}


def chat_body(body: dict) -> dict:
    """The request as a /v1/chat/completions body (what is left to check is checked there)."""
    if body.get("container") is not None:
        raise bad("container", "containers are not supported: Kiln has no code execution tool", "unsupported_field")
    known_fields(body, FIELDS | IGNORED)
    if body.get("speed") not in (None, "standard"):
        raise bad("speed", 'speed must be "standard": Kiln has no faster mode to switch to')
    mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise bad("max_tokens", "max_tokens is required: a positive integer")
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "top_k", "stream", "adapter", "adapter_scale",
                                                  "keep_alive") if k in body}
    chat.update(messages=chat_messages(body), max_tokens=mt)
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    ts = body.get("tools")
    if ts is not None:
        if not isinstance(ts, list):
            raise bad("tools", "tools must be a list", "invalid_type")
        chat["tools"] = []
        for i, t in enumerate(ts):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
                raise bad(f"tools[{i}]", "only custom tools ({name, description, input_schema}) are supported: "
                                         "Kiln has no server tools")
            _no_extras(t, {"type", "name", "description", "input_schema"}, f"tools[{i}]")
            f = {"name": t.get("name"), "parameters": t["input_schema"]}
            if t.get("description") is not None:
                f["description"] = t["description"]
            chat["tools"].append({"type": "function", "function": f})
    tc = body.get("tool_choice")
    if tc is not None:
        kind = tc.get("type") if isinstance(tc, dict) else None
        if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(tc.get("name"), str)):
            raise bad("tool_choice", 'tool_choice is {"type": "auto" | "any" | "none"} or {"type": "tool", "name": …}')
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            kind, {"type": "function", "function": {"name": tc.get("name")}})
        if tc.get("disable_parallel_tool_use") is not None:
            chat["parallel_tool_calls"] = not tc["disable_parallel_tool_use"]
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad("thinking", 'thinking is {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}')
        # budget_tokens: max_tokens caps thinking and answer together here (README); adaptive:
        # the model's own default. A hint: a model with no thinking switch answers as it does.
        if kind != "adaptive":
            chat.setdefault("template_hints", {})["enable_thinking"] = kind == "enabled"
    cm = body.get("context_management")
    if cm is not None:
        edits = cm.get("edits") if isinstance(cm, dict) else None
        if not isinstance(edits, list) or set(cm) - {"edits"}:
            raise bad("context_management", 'context_management is {"edits": […]}')
        for i, e in enumerate(edits):
            # earlier turns' thinking is always dropped here (the templates drop it): a
            # clear_thinking edit asks for no more; clearing tool results is not done
            if not (isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking_")):
                raise bad(f"context_management.edits[{i}]", "only clear_thinking edits are supported: Kiln does not "
                                                            "clear earlier tool results (the prompt is sent whole)")
    oc = body.get("output_config")
    if oc is not None:
        if not isinstance(oc, dict) or set(oc) - {"effort", "format"}:
            raise bad("output_config", 'output_config is {"effort": …, "format": {"type": "json_schema", "schema": …}}')
        if oc.get("effort") is not None:
            if oc["effort"] not in EFFORT:
                raise bad("output_config.effort", f"effort must be one of {', '.join(EFFORT)}")
            chat.setdefault("template_hints", {})["reasoning_effort"] = EFFORT[oc["effort"]]
        fmt = oc.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise bad("output_config.format", 'format is {"type": "json_schema", "schema": {…}}')
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return chat


# a chat field's name -> the Messages API field it came from, for the errors users read
_RENAMES = ((".function.parameters", ".input_schema"), (".function.", "."),
            ("response_format.json_schema.schema", "output_config.format.schema"),
            ("reasoning_effort", "output_config.effort"))


def _stop_reason(final: dict) -> tuple[str, str | None]:
    reason = final.get("finish_reason")
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if final.get("stop_string") is not None:
        return "stop_sequence", final["stop_string"]
    return "end_turn", None


def _usage(final: dict) -> dict:
    u = final["usage"]
    cached = u.get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": u["completion_tokens"]}


def _tool_use(c: dict) -> dict:
    try:
        args = json.loads(c["arguments"]) if c["arguments"] else {}
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": c["id"], "name": c["name"], "input": args if isinstance(args, dict) else {}}


class Messages:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def on_post(self, req, resp):
        body = self.pipe.read_json(req)
        chat = chat_body(body)
        # max_tokens is an upper bound here, as Anthropic's clients use it (Claude Code asks for
        # 32000 whatever the model): past the context's end the answer stops with max_tokens
        work = to_work(chat, fetching(self.pipe.sup), params=sampling_params(chat), clip_max_tokens=True)
        self.pipe.generate(req, resp, work, MessageShape(), stream_flag(chat))

    def on_post_count_tokens(self, req, resp):
        """The prompt's tokens as the model's template renders it (with the tools)."""
        body = self.pipe.read_json(req)
        body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
        chat = chat_body({**body, "max_tokens": 1})
        work = to_work(chat, fetching(self.pipe.sup)).body()
        ask = {k: work[k] for k in ("messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                                    "chat_template_kwargs", "reasoning_effort", "template_hints", "model", "images")
               if k in work}
        ask.pop("response_format", None)              # apply_template renders; it does not constrain
        out, _ = self.pipe.call(req, "apply_template", ask, 60, shape=MessageShape())
        resp.media = {"input_tokens": len(out["tokens"])}


def to_work(chat: dict, fetch: bool = False, **more) -> Work:
    images = Images(fetch)
    return Work(messages=messages(chat, images), model=model_of(chat), **tools_named(chat, _RENAMES), **adapter(chat),
                **keep_alive(chat), template_hints=chat.get("template_hints") or None, **images.work(), **more)


def _sse(kind: str, **data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


class MessageShape(Shape):
    """A message: whole, or Anthropic's stream — message_start, each content block (start,
    deltas, stop), message_delta with the stop reason and usage, message_stop; a worker lost
    mid-answer ends it with an error event."""

    keepalive = _sse("ping")                  # a long prefill: keep the client

    def __init__(self):
        self.index, self.open_kind, self.started = -1, None, False

    def start(self, model: str) -> None:
        self.meta = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model}

    def _message_start(self, b: dict) -> Iterator[bytes]:
        """message_start once the prompt's size is known (the first token's chunk says it; pings
        keep the client during a long prefill), with its input tokens as Anthropic's API gives them."""
        if self.started:
            return
        self.started = True
        u = b.get("usage") or b
        cached = u.get("cached_tokens", 0)
        yield _sse("message_start", message={**self.meta, "content": [], "stop_reason": None, "stop_sequence": None,
                                             "usage": {"input_tokens": u.get("prompt_tokens", 0) - cached,
                                                       "cache_read_input_tokens": cached,
                                                       "cache_creation_input_tokens": 0, "output_tokens": 0}})

    def _switch(self, kind: str, block: dict) -> Iterator[bytes]:
        if self.open_kind is not None:
            yield _sse("content_block_stop", index=self.index)
        self.index += 1
        self.open_kind = kind
        yield _sse("content_block_start", index=self.index, content_block=block)

    def part(self, b: dict):
        yield from self._message_start(b)
        if b.get("reasoning"):
            if self.open_kind != "thinking":
                yield from self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield _sse("content_block_delta", index=self.index, delta={"type": "thinking_delta", "thinking": b["reasoning"]})
        if b.get("text"):
            if self.open_kind != "text":
                yield from self._switch("text", {"type": "text", "text": ""})
            yield _sse("content_block_delta", index=self.index, delta={"type": "text_delta", "text": b["text"]})
        for c in b.get("tool_calls", []):
            block = _tool_use(c)
            yield from self._switch("tool_use", {**block, "input": {}})
            yield _sse("content_block_delta", index=self.index, delta={"type": "input_json_delta",
                                                                        "partial_json": json.dumps(block["input"])})

    def closing(self, final: dict):
        yield from self.part(final)
        if self.open_kind is None:                         # nothing said: one empty text block
            yield from self._switch("text", {"type": "text", "text": ""})
        yield _sse("content_block_stop", index=self.index)
        reason, seq = _stop_reason(final)
        yield _sse("message_delta", delta={"stop_reason": reason, "stop_sequence": seq}, usage=_usage(final))
        yield _sse("message_stop")

    def failed(self, err):
        e = err.kiln_body["error"]
        yield _sse("error", error={"type": "overloaded_error" if e.get("code") == "worker_crashed" else "api_error",
                                   "message": e["message"]})

    def whole(self, parts: list[dict], final: dict) -> dict:
        every = parts + [final]
        thinking = "".join(p.get("reasoning", "") for p in every)
        text = "".join(p.get("text", "") for p in every)
        calls = [c for p in every for c in p.get("tool_calls", [])]
        content = ([{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []) \
            + ([{"type": "text", "text": text}] if text or not calls else []) + [_tool_use(c) for c in calls]
        reason, seq = _stop_reason(final)
        return {**self.meta, "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": _usage(final)}


def install(app, sup, pipe: Pipeline) -> None:
    m = Messages(pipe)
    app.add_route("/v1/messages", m)
    app.add_route("/v1/messages/count_tokens", m, suffix="count_tokens")
