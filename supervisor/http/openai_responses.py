"""OpenAI's Responses API, stateless (as Ollama's and llama-server's): POST /v1/responses.

A request is translated into the chat work /v1/chat/completions sends — `input` items become
messages, `instructions` the system message, the flat function tools the chat tools, `text.format`
the response_format, `reasoning.effort` the reasoning_effort — so it is validated and generated
the same way; the answer comes back as Response output items (reasoning, message, function_call),
whole or as the Responses stream events (openai_responses_shapes.py); with `include:
["message.output_text.logprobs"]` each token's log-probability. Nothing is stored: `store: true`, `previous_response_id`
and `conversation` are refused with what to do instead."""

from __future__ import annotations

from typing import Any

from .images import Images, fetching
from .openai_responses_shapes import LOGPROBS, ResponseShape
from .pipeline import Pipeline, stream_flag
from .openai_validate import (IGNORED, adapter, bad, keep_alive, known_fields, logprobs, messages, sampling_params,
                              tools_named, truncation)
from .work import Work, model_of

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "stream", "temperature",
          "top_p", "max_output_tokens", "text", "reasoning", "store", "truncation", "adapter", "adapter_scale", "keep_alive",
          "include", "top_logprobs", "context_shift"} | IGNORED
_STATEFUL = {"previous_response_id": "Kiln keeps no responses: send the whole conversation in input",
             "conversation": "Kiln keeps no conversations: send the whole conversation in input",
             "background": "Kiln answers in the foreground only; use stream for long answers",
             "prompt": "Kiln has no stored prompt templates: send instructions and input"}


def _text_of(content, where: str):
    """A message's content: a string, or input_text / output_text parts (chat parts when it
    holds an input_image: a data: URI in image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "content must be a string or a list of input_text parts", "invalid_type")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "input_image":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if part.get("file_id") is not None:
                raise bad(f"{where}[{j}].file_id", "Kiln keeps no files: send the image as a data: URI in image_url")
            if not (isinstance(url, str) and url.lower().startswith(("data:", "http://", "https://"))):
                raise bad(f"{where}[{j}]", "an input_image's image_url must be a data: URI (data:image/png;base64,…)")
            out.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in ("input_file", "input_audio"):
            raise bad(f"{where}[{j}]", f"{kind} is not supported: send text or images")
        else:
            raise bad(f"{where}[{j}]", 'a content part is {"type": "input_text", "text": …} or {"type": '
                                       '"input_image", "image_url": "data:image/png;base64,…"}')
    if any(isinstance(o, dict) for o in out):
        return [o if isinstance(o, dict) else {"type": "text", "text": o} for o in out]
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
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls",
                                                  "tool_choice", "adapter", "adapter_scale", "keep_alive", "truncation", "context_shift")
                              if k in body}
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
    chat.update(_logprobs(body))
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"}:
            raise bad("reasoning", 'reasoning must be {"effort": …}')
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _logprobs(body: dict) -> dict:
    """include: [LOGPROBS] asks for each output token's log-probability, `top_logprobs` (0–20)
    for that many alternatives with each — what Kiln can include (it stores nothing else)."""
    include, top = body.get("include"), body.get("top_logprobs")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise bad("include", "include must be a list of strings", "invalid_type")
        for x in include:
            if x != LOGPROBS:
                raise bad("include", f"include {x!r} is not supported: Kiln keeps no stored or encrypted items "
                                     f"(it can include {LOGPROBS!r})")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise bad("top_logprobs", "top_logprobs must be an integer from 0 to 20")
    if LOGPROBS in (include or []):
        return {"logprobs": True, "top_logprobs": top or 0}
    if top:
        raise bad("top_logprobs", f"top_logprobs needs include: [{LOGPROBS!r}]")
    return {}


class Responses:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def on_post(self, req, resp):
        body = self.pipe.read_json(req)
        chat = chat_body(body)
        images = Images(fetching(self.pipe.sup))
        work = Work(messages=messages(chat, images), model=model_of(chat), **tools_named(chat, _RENAMES),
                    **adapter(chat), **keep_alive(chat), **truncation(chat), params=sampling_params(chat),
                    **images.work())
        if (lp := logprobs(chat, chat=True)) is not None:
            work.params["logprobs"] = lp
        self.pipe.generate(req, resp, work, ResponseShape(body), stream_flag(chat))


# a chat field's name -> the Responses field it came from, for the errors users read
_RENAMES = ((".function.", "."), ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("reasoning_effort", "reasoning.effort"))


def install(app, sup, pipe: Pipeline) -> None:
    app.add_route("/v1/responses", Responses(pipe))
