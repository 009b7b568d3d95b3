"""The shapes of OpenAI responses built from a worker's messages: whole answers, stream events,
usage and log-probabilities. Pure functions: no daemon, no socket."""

from __future__ import annotations

import json


def finish_reason(final: dict) -> str:
    return "length" if final["finish_reason"] == "length" else "stop"


def usage(final: dict) -> dict:
    u = final["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def chat_logprobs(toks: list[dict]) -> dict:
    return {"content": [{"token": t["piece"], "logprob": t["logprob"], "bytes": list(t["piece"].encode()),
                         "top_logprobs": [{"token": p, "logprob": l, "bytes": list(p.encode())}
                                          for _, l, p in t["top_logprobs"]]} for t in toks]}


def completion_logprobs(toks: list[dict]) -> dict:
    offsets, pos = [], 0
    for t in toks:
        offsets.append(pos)
        pos += len(t["piece"])
    return {"tokens": [t["piece"] for t in toks], "token_logprobs": [t["logprob"] for t in toks],
            "top_logprobs": [{p: l for _, l, p in t["top_logprobs"]} for t in toks], "text_offset": offsets}


def whole(meta: dict, chat: bool, text: str, toks: list[dict], final: dict, with_lp: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": chat_logprobs(toks) if with_lp else None, "finish_reason": finish_reason(final)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": completion_logprobs(toks) if with_lp else None,
                  "finish_reason": finish_reason(final)}
        obj = "text_completion"
    return {**meta, "object": obj, "choices": [choice], "usage": usage(final), "system_fingerprint": "kiln"}


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return b"data: " + data.encode() + b"\n\n"


class StreamShapes:
    """The events of one streamed answer (chat.completion.chunk or text_completion)."""

    def __init__(self, meta: dict, chat: bool, with_lp: bool):
        self.meta, self.chat, self.with_lp = meta, chat, with_lp
        self.obj = "chat.completion.chunk" if chat else "text_completion"

    def event(self, choice: dict | None, **extra) -> bytes:
        return sse({**self.meta, "object": self.obj, "choices": [choice] if choice else [], **extra})

    def opening(self) -> list[bytes]:
        if not self.chat:
            return []
        return [self.event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})]

    def token(self, t: dict) -> bytes | None:
        if not t["text"] and not self.with_lp:
            return None
        if self.chat:
            return self.event({"index": 0, "delta": {"content": t["text"]},
                               "logprobs": chat_logprobs([t]) if self.with_lp else None, "finish_reason": None})
        return self.event({"index": 0, "text": t["text"],
                           "logprobs": completion_logprobs([t]) if self.with_lp else None, "finish_reason": None})

    def closing(self, final: dict, include_usage: bool) -> list[bytes]:
        out = []
        if self.chat:
            if final["text"]:
                out.append(self.event({"index": 0, "delta": {"content": final["text"]}, "logprobs": None,
                                       "finish_reason": None}))
            out.append(self.event({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason(final)}))
        else:
            out.append(self.event({"index": 0, "text": final["text"], "logprobs": None,
                                   "finish_reason": finish_reason(final)}))
        if include_usage:
            out.append(self.event(None, usage=usage(final)))
        return out
