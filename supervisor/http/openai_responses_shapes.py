"""What a Response says (OpenAI's Responses API, supervisor/http/openai_responses.py): its output
items — reasoning, the message, function calls — accumulated as the answer comes, given whole or
as the Responses stream events; each output token's log-probability when `include` asks."""

from __future__ import annotations

import json
import time
import uuid
from typing import Iterator

from .common import JSONError, context_notes, token_logprobs
from .pipeline import Shape

LOGPROBS = "message.output_text.logprobs"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Output:
    """The answer's output items, accumulated: reasoning, then the message, then function calls."""

    def __init__(self):
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.calls: list[dict] = []
        self.logprobs: list[dict] | None = None       # the tokens' log-probabilities, when included
        self.ids = {"rs": _id("rs"), "msg": _id("msg")}

    def add(self, part: dict) -> None:
        self.reasoning.append(part.get("reasoning", ""))
        self.text.append(part.get("text", ""))
        self.calls += part.get("tool_calls", [])
        if self.logprobs is not None:
            self.logprobs += token_logprobs([part])

    def reasoning_item(self, text: str) -> dict:
        return {"type": "reasoning", "id": self.ids["rs"], "summary": [{"type": "summary_text", "text": text}]}

    def message_item(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.ids["msg"], "status": status, "role": "assistant",
                "content": [_text_part(text, self.logprobs)]}

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


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _usage(final: dict) -> dict:
    u = final["usage"]
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _finished(shell: dict, items: list[dict], final: dict) -> dict:
    cut = final.get("finish_reason") == "length"
    return {**shell, "status": "incomplete" if cut else "completed", "output": items, "usage": _usage(final),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            **context_notes(final)}


class ResponseShape(Shape):
    """A Response: whole, or the Responses stream — created, in_progress, each output item added →
    its deltas → done, then completed (or incomplete); a worker lost mid-answer ends it with
    response.failed."""

    param = "input"

    def __init__(self, body: dict):
        self.body = body
        self.seq, self.index, self.open_kind = 0, -1, None
        self.out, self.done_items = Output(), []
        self.with_lp = LOGPROBS in (body.get("include") or [])
        self.unsaid: list[dict] = []        # log-probabilities of tokens whose text is not out yet
        if self.with_lp:
            self.out.logprobs = []

    def start(self, model: str) -> None:
        b = self.body
        self.shell = {"id": _id("resp"), "object": "response", "created_at": int(time.time()),
                      "model": model, "instructions": b.get("instructions"),
                      "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice", "auto"),
                      "parallel_tool_calls": b.get("parallel_tool_calls", True),
                      "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                      "max_output_tokens": b.get("max_output_tokens"), "previous_response_id": None,
                      "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
                      "text": b.get("text") or {"format": {"type": "text"}}, "truncation": b.get("truncation") or "disabled",
                      "store": False, "metadata": b.get("metadata") or {}, "error": None,
                      "incomplete_details": None, "usage": None}

    def refused(self, err: JSONError) -> JSONError:
        e = err.kiln_body["error"]
        if e.get("code") == "context_length_exceeded":      # the input, and max_output_tokens
            e.update(param="input", message=e["message"].replace("max_tokens", "max_output_tokens"))
        return err

    def whole(self, parts: list[dict], final: dict) -> dict:
        out = Output()
        if self.with_lp:
            out.logprobs = []
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
                     text=text, logprobs=out.logprobs or [])
            yield ev("response.content_part.done", item_id=out.ids["msg"], output_index=index, content_index=0,
                     part=_text_part(text, out.logprobs))
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
        if self.with_lp:
            mine = token_logprobs([body])
            self.unsaid += mine
            out.logprobs += mine
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
            said, self.unsaid = self.unsaid, []
            yield ev("response.output_text.delta", item_id=out.ids["msg"], output_index=self.index, content_index=0,
                     delta=body["text"], logprobs=said)
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
