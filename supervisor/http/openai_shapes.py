"""The shapes of OpenAI responses built from a worker's messages: whole answers, stream events,
usage and log-probabilities (`Answer`: the pipeline's Shape). No daemon, no socket."""

from __future__ import annotations

import json
import time
import uuid

from .common import context_notes, token_logprobs
from .pipeline import Shape


def finish_reason(final: dict) -> str:
    r = final["finish_reason"]
    return r if r in ("length", "tool_calls") else "stop"


def openai_call(c: dict) -> dict:
    return {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}


class Choice:
    """One choice of an answer, accumulated from the worker's chunks and final."""

    def __init__(self, index: int):
        self.index = index
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []
        self.toks: list[dict] = []
        self.final: dict | None = None

    def add(self, part: dict, is_token: bool = True) -> None:
        self.text.append(part.get("text", ""))
        self.reasoning.append(part.get("reasoning", ""))
        self.calls += part.get("tool_calls", [])
        if is_token:
            self.toks.append(part)

    def close(self, final: dict) -> None:
        self.add(final, is_token=False)
        self.final = final

    def whole(self, chat: bool, with_lp: bool) -> dict:
        text = "".join(self.text)
        if not chat:
            return {"index": self.index, "text": text, "logprobs": completion_logprobs(self.toks) if with_lp else None,
                    "finish_reason": finish_reason(self.final)}
        msg: dict = {"role": "assistant", "content": text if text or not self.calls else None}
        if any(self.reasoning):
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [openai_call(c) for c in self.calls]
        return {"index": self.index, "message": msg, "logprobs": chat_logprobs(self.toks) if with_lp else None,
                "finish_reason": finish_reason(self.final)}


def usage(final: dict) -> dict:
    u = final["usage"]
    out = {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
           "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
           "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}
    if u.get("draft_tokens"):        # prompt-lookup drafts checked: kept and thrown away
        out["completion_tokens_details"] = {"accepted_prediction_tokens": u["accepted_tokens"],
                                            "rejected_prediction_tokens": u["draft_tokens"] - u["accepted_tokens"]}
    return out


def chat_logprobs(toks: list[dict]) -> dict:
    return {"content": token_logprobs(toks)}


def completion_logprobs(toks: list[dict]) -> dict:
    offsets, pos = [], 0
    for t in toks:
        offsets.append(pos)
        pos += len(t["piece"])
    return {"tokens": [t["piece"] for t in toks], "token_logprobs": [t["logprob"] for t in toks],
            "top_logprobs": [{p: l for _, l, p in t["top_logprobs"]} for t in toks], "text_offset": offsets}


def whole(meta: dict, chat: bool, choices: list[Choice], usage_of: dict, with_lp: bool) -> dict:
    return {**meta, "object": "chat.completion" if chat else "text_completion",
            "choices": [c.whole(chat, with_lp) for c in choices], "usage": usage(usage_of),
            "system_fingerprint": "kiln", **context_notes(usage_of)}


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return b"data: " + data.encode() + b"\n\n"


class StreamShapes:
    """The events of one streamed answer (chat.completion.chunk or text_completion). A tool
    call streams as two deltas: its index, id and name, then its arguments."""

    def __init__(self, meta: dict, chat: bool, with_lp: bool, n: int = 1):
        self.meta, self.chat, self.with_lp, self.n = meta, chat, with_lp, n
        self.obj = "chat.completion.chunk" if chat else "text_completion"

    def event(self, choice: dict | None, **extra) -> bytes:
        return sse({**self.meta, "object": self.obj, "choices": [choice] if choice else [], **extra})

    def opening(self) -> list[bytes]:
        if not self.chat:
            return []
        return [self.event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}) for i in range(self.n)]

    def part(self, t: dict, is_token: bool = True) -> list[bytes]:
        """The events of one chunk (or of a final's tail when not is_token)."""
        i = t.get("index", 0)
        lp = is_token and self.with_lp
        out = []
        if not self.chat:
            if t.get("text") or lp:
                out.append(self.event({"index": i, "text": t.get("text", ""),
                                       "logprobs": completion_logprobs([t]) if lp else None, "finish_reason": None}))
            return out
        delta = {}
        if t.get("reasoning"):
            delta["reasoning_content"] = t["reasoning"]
        if t.get("text") or (lp and not t.get("tool_calls")):
            delta["content"] = t.get("text", "")
        if delta or lp:
            out.append(self.event({"index": i, "delta": delta, "logprobs": chat_logprobs([t]) if lp else None,
                                   "finish_reason": None}))
        for c in t.get("tool_calls", []):
            head = {"index": c["index"], "id": c["id"], "type": "function",
                    "function": {"name": c["name"], "arguments": ""}}
            out.append(self.event({"index": i, "delta": {"tool_calls": [head]}, "logprobs": None, "finish_reason": None}))
            out.append(self.event({"index": i, "delta": {"tool_calls": [{"index": c["index"], "function": {
                "arguments": c["arguments"]}}]}, "logprobs": None, "finish_reason": None}))
        return out

    def closing(self, finals: list[dict], usage_of: dict, include_usage: bool) -> list[bytes]:
        out = []
        for f in finals:
            out += self.part(f, is_token=False)
            i = f.get("index", 0)
            if self.chat:
                out.append(self.event({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish_reason(f)},
                                      **context_notes(f)))
            else:
                out.append(self.event({"index": i, "text": "", "logprobs": None, "finish_reason": finish_reason(f)}))
        if include_usage:
            out.append(self.event(None, usage=usage(usage_of)))
        return out


class Answer(Shape):
    """A chat.completion or text_completion answer: whole, or its chunks, `[DONE]` last (an error
    event before it when the worker is lost mid-answer)."""

    def __init__(self, chat: bool, with_lp: bool, n: int = 1, include_usage: bool = False):
        self.chat, self.with_lp, self.n, self.include_usage = chat, with_lp, n, include_usage
        self.param = "messages" if chat else "prompt"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]

    def start(self, model: str) -> None:
        self.meta = {"id": self.id, "created": int(time.time()), "model": model}
        self.events = StreamShapes(self.meta, self.chat, self.with_lp, self.n)

    def opening(self):
        return self.events.opening()

    def part(self, chunk: dict):
        return self.events.part(chunk)

    def closing(self, final: dict):
        return self.events.closing(final.get("choices", [final]), final, self.include_usage) + [sse("[DONE]")]

    def failed(self, err):
        return [sse(err.kiln_body), sse("[DONE]")]

    def whole(self, parts: list[dict], final: dict) -> dict:
        choices = [Choice(i) for i in range(self.n)]
        for p in parts:
            choices[p.get("index", 0)].add(p)
        for f in final.get("choices", [final]):
            choices[f.get("index", 0)].close(f)
        return whole(self.meta, self.chat, choices, final, self.with_lp)
