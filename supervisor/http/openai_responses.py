"""OpenAI's Responses API, stateless (as Ollama's and llama-server's): POST /v1/responses.

A request is translated into the chat work /v1/chat/completions sends — `input` items become
messages, `instructions` the system message, the flat function tools the chat tools, `text.format`
the response_format, `reasoning.effort` the reasoning_effort — so it is validated and generated
the same way; the answer comes back as Response output items (reasoning, message, function_call),
whole or as the Responses stream events. Nothing is stored: `store: true`, `previous_response_id`
and `conversation` are refused with what to do instead."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

from .common import JSONError
from .pipeline import Pipeline, Shape, stream_flag
from .openai_validate import IGNORED, adapter, bad, keep_alive, known_fields, messages, sampling_params, tools_named
from .work import Work, model_of

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "stream", "temperature",
          "top_p", "max_output_tokens", "text", "reasoning", "store", "truncation", "adapter", "keep_alive"} | IGNORED
_STATEFUL = {"previous_response_id": "Kiln keeps no responses: send the whole conversation in input",
             "conversation": "Kiln keeps no conversations: send the whole conversation in input",
             "background": "Kiln answers in the foreground only; use stream for long answers",
             "include": "Kiln has nothing more to include (no stored or encrypted items)",
             "prompt": "Kiln has no stored prompt templates: send instructions and input"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text_of(content, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "content must be a string or a list of input_text parts", "invalid_type")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{where}[{j}]", f"{kind} is not supported: Kiln serves text models")
        else:
            raise bad(f"{where}[{j}]", 'a content part is {"type": "input_text", "text": …}')
    return "".join(out)


def input_messages(body: dict) -> list[dict]:
    """`instructions` and `input` as chat messages. Consecutive function_call items become one
    assistant message's tool_calls (after that turn's text, if any); a function_call_output is a
    tool message. Reasoning items of earlier turns are dropped, as chat templates drop earlier
    turns' thinking."""
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "instructions must be a string", "invalid_type")
        if instructions:
            out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "input must be a string or a non-empty list of items",
                  "invalid_value" if isinstance(items, list) else "invalid_type")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "each input item must be an object", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role", f"role must be user, assistant, system or developer, got {role!r}")
            out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise bad(f"{where}.{k}", f"a function_call needs {k} (a string)", "invalid_type")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id", "a function_call_output needs the call_id it answers", "invalid_type")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad(f"{where}.type", f"input item type {kind!r} is not supported (message, function_call, "
                                       f"function_call_output, reasoning)")
    if not any(m["role"] != "system" for m in out):
        raise bad("input", "input has no message to answer")
    return out


def chat_body(body: dict) -> dict:
    """The request as a /v1/chat/completions body (what is left to check is checked there)."""
    for k, why in _STATEFUL.items():
        if k in body:
            raise bad(k, f"{k} is not supported: {why}", "unsupported_field")
    known_fields(body, FIELDS)
    if body.get("store") not in (None, False):
        raise bad("store", "store must be false: Kiln keeps no responses (leave it out or set it false)")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation", 'truncation must be "disabled": Kiln refuses an input longer than the context '
                                "instead of dropping its start")
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls",
                                                  "tool_choice", "adapter", "keep_alive") if k in body}
    chat["messages"] = input_messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    ts = body.get("tools")
    if ts is not None:
        if not isinstance(ts, list):
            raise bad("tools", "tools must be a list of functions", "invalid_type")
        chat["tools"] = []
        for i, t in enumerate(ts):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad(f"tools[{i}]", "only function tools are supported (Kiln has no built-in tools)")
            chat["tools"].append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": …}')
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or not isinstance(fmt, (dict, type(None))):
            raise bad("text", 'text must be {"format": {"type": "text" | "json_object" | "json_schema", …}}')
        if text.get("verbosity") not in (None, "medium"):
            raise bad("text.verbosity", "verbosity is not supported (the model's own length applies)")
        if fmt and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
        elif fmt:
            chat["response_format"] = {"type": fmt.get("type")}
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"}:
            raise bad("reasoning", 'reasoning must be {"effort": …}')
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


class Responses:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def on_post(self, req, resp):
        body = self.pipe.read_json(req)
        chat = chat_body(body)
        work = Work(messages=messages(chat), model=model_of(chat), **tools_named(chat, _RENAMES), **adapter(chat),
                    **keep_alive(chat), params=sampling_params(chat))
        self.pipe.generate(req, resp, work, ResponseShape(body), stream_flag(chat))


# a chat field's name -> the Responses field it came from, for the errors users read
_RENAMES = ((".function.", "."), ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("reasoning_effort", "reasoning.effort"))


class Output:
    """The answer's output items, accumulated: reasoning, then the message, then function calls."""

    def __init__(self):
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.calls: list[dict] = []
        self.ids = {"rs": _id("rs"), "msg": _id("msg")}

    def add(self, part: dict) -> None:
        self.reasoning.append(part.get("reasoning", ""))
        self.text.append(part.get("text", ""))
        self.calls += part.get("tool_calls", [])

    def reasoning_item(self, text: str) -> dict:
        return {"type": "reasoning", "id": self.ids["rs"], "summary": [{"type": "summary_text", "text": text}]}

    def message_item(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.ids["msg"], "status": status, "role": "assistant",
                "content": [_text_part(text)]}

    @staticmethod
    def call_item(c: dict) -> dict:
        return {"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
                "name": c["name"], "arguments": c["arguments"], "status": "completed"}

    def items(self) -> list[dict]:
        out = []
        if "".join(self.reasoning):
            out.append(self.reasoning_item("".join(self.reasoning)))
        text = "".join(self.text)
        if text or not self.calls:
            out.append(self.message_item(text))
        return out + [self.call_item(c) for c in self.calls]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(final: dict) -> dict:
    u = final["usage"]
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _finished(shell: dict, items: list[dict], final: dict) -> dict:
    cut = final.get("finish_reason") == "length"
    return {**shell, "status": "incomplete" if cut else "completed", "output": items, "usage": _usage(final),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


class ResponseShape(Shape):
    """A Response: whole, or the Responses stream — created, in_progress, each output item added →
    its deltas → done, then completed (or incomplete); a worker lost mid-answer ends it with
    response.failed."""

    param = "input"

    def __init__(self, body: dict):
        self.body = body
        self.seq, self.index, self.open_kind = 0, -1, None
        self.out, self.done_items = Output(), []

    def start(self, model: str) -> None:
        b = self.body
        self.shell = {"id": _id("resp"), "object": "response", "created_at": int(time.time()),
                      "model": model, "instructions": b.get("instructions"),
                      "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice", "auto"),
                      "parallel_tool_calls": b.get("parallel_tool_calls", True),
                      "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                      "max_output_tokens": b.get("max_output_tokens"), "previous_response_id": None,
                      "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
                      "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
                      "store": False, "metadata": b.get("metadata") or {}, "error": None,
                      "incomplete_details": None, "usage": None}

    def refused(self, err: JSONError) -> JSONError:
        e = err.kiln_body["error"]
        if e.get("code") == "context_length_exceeded":      # the input, and max_output_tokens
            e.update(param="input", message=e["message"].replace("max_tokens", "max_output_tokens"))
        return err

    def whole(self, parts: list[dict], final: dict) -> dict:
        out = Output()
        for p in parts + [final]:
            out.add(p)
        return _finished(self.shell, out.items(), final)

    # -- the stream --

    def _ev(self, kind: str, **data) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def opening(self):
        yield self._ev("response.created", response={**self.shell, "status": "in_progress", "output": []})
        yield self._ev("response.in_progress", response={**self.shell, "status": "in_progress", "output": []})

    def _close_open(self) -> Iterator[bytes]:
        out, index, ev = self.out, self.index, self._ev
        if self.open_kind == "reasoning":
            text = "".join(out.reasoning)
            part = {"type": "summary_text", "text": text}
            yield ev("response.reasoning_summary_text.done", item_id=out.ids["rs"], output_index=index,
                     summary_index=0, text=text)
            yield ev("response.reasoning_summary_part.done", item_id=out.ids["rs"], output_index=index,
                     summary_index=0, part=part)
            item = out.reasoning_item(text)
        elif self.open_kind == "message":
            text = "".join(out.text)
            yield ev("response.output_text.done", item_id=out.ids["msg"], output_index=index, content_index=0,
                     text=text, logprobs=[])
            yield ev("response.content_part.done", item_id=out.ids["msg"], output_index=index, content_index=0,
                     part=_text_part(text))
            item = out.message_item(text)
        else:
            return
        self.done_items.append(item)
        yield ev("response.output_item.done", output_index=index, item=item)
        self.open_kind = None

    def _open_item(self, kind: str) -> Iterator[bytes]:
        yield from self._close_open()
        self.index += 1
        self.open_kind = kind
        out, index, ev = self.out, self.index, self._ev
        if kind == "reasoning":
            yield ev("response.output_item.added", output_index=index, item={**out.reasoning_item(""), "summary": []})
            yield ev("response.reasoning_summary_part.added", item_id=out.ids["rs"], output_index=index,
                     summary_index=0, part={"type": "summary_text", "text": ""})
        else:
            yield ev("response.output_item.added", output_index=index,
                     item={**out.message_item("", "in_progress"), "content": []})
            yield ev("response.content_part.added", item_id=out.ids["msg"], output_index=index, content_index=0,
                     part=_text_part(""))

    def part(self, body: dict):
        out, ev = self.out, self._ev
        if body.get("reasoning"):
            if self.open_kind != "reasoning":
                yield from self._open_item("reasoning")
            out.reasoning.append(body["reasoning"])
            yield ev("response.reasoning_summary_text.delta", item_id=out.ids["rs"], output_index=self.index,
                     summary_index=0, delta=body["reasoning"])
        if body.get("text"):
            if self.open_kind != "message":
                yield from self._open_item("message")
            out.text.append(body["text"])
            yield ev("response.output_text.delta", item_id=out.ids["msg"], output_index=self.index, content_index=0,
                     delta=body["text"], logprobs=[])
        for c in body.get("tool_calls", []):
            yield from self._close_open()
            self.index += 1
            item = out.call_item(c)
            out.calls.append(c)
            yield ev("response.output_item.added", output_index=self.index, item={**item, "arguments": "",
                                                                                   "status": "in_progress"})
            yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=self.index,
                     delta=item["arguments"])
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                     name=item["name"], arguments=item["arguments"])
            self.done_items.append(item)
            yield ev("response.output_item.done", output_index=self.index, item=item)

    def closing(self, final: dict):
        yield from self.part(final)
        if not self.done_items and self.open_kind is None:          # nothing said: an empty message
            yield from self._open_item("message")
        yield from self._close_open()
        whole = _finished(self.shell, self.done_items, final)
        yield self._ev("response.completed" if whole["status"] == "completed" else "response.incomplete",
                       response=whole)

    def failed(self, err: JSONError):
        e = err.kiln_body["error"]
        yield self._ev("response.failed", response={**self.shell, "status": "failed", "output": self.done_items,
                                                    "error": {"code": e["code"], "message": e["message"]}})


def install(app, sup, pipe: Pipeline) -> None:
    app.add_route("/v1/responses", Responses(pipe))
