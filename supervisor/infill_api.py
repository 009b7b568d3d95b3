"""`POST /infill` — llama-server's code-infilling route, for editor plugins written against it.

The body names the code before and after the cursor (`input_prefix`, `input_suffix`), other
files for context (`input_extra`: [{filename, text}]) and the start of the middle already typed
(`prompt`); the worker lays them out as llama-server does (native/fim.py, repo-level). The
answer is llama-server's native completion object (`content`, `stop`, `tokens_predicted`,
`tokens_evaluated`, `stop_type`, `timings`, …), streamed as `data: {…}` events with no
`[DONE]`, as llama-server streams its native routes.

llama-server's other knobs (`samplers` and its `infill` sampler, `n_indent`, `t_max_*_ms`,
`id_slot`, `lora`, …) are refused by name: a field Kiln would have to ignore is an error.
"""

from __future__ import annotations

import json
from typing import Iterator

from .http_common import JSONError, error_from
from .openai_api import IDLE, Answer, WorkerGone
from .openai_validate import adapter, bad, keep_alive, known_fields, sampling_params

_SAMPLING = {"temperature", "top_k", "top_p", "min_p", "typical_p", "seed", "stop", "repeat_penalty",
             "presence_penalty", "frequency_penalty", "ignore_eos", "logit_bias"}
FIELDS = {"model", "input_prefix", "input_suffix", "input_extra", "prompt", "stream", "n_predict", "max_tokens",
          "cache_prompt", "adapter", "keep_alive"} | _SAMPLING


def infill_work(body: dict) -> dict:
    """The generate op's `infill` field from an /infill body (400 naming a bad field)."""
    texts = {}
    for field, key in (("input_prefix", "prefix"), ("input_suffix", "suffix"), ("prompt", "middle")):
        v = body.get(field, "")
        if not isinstance(v, str):
            raise bad(field, f"{field} must be a string", "invalid_type")
        texts[key] = v
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise bad("input_extra", "input_extra must be a list of {\"filename\", \"text\"} objects", "invalid_type")
    files = []
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) or \
                not isinstance(chunk.get("filename", "tmp"), str) or set(chunk) - {"filename", "text"}:
            raise bad(f"input_extra[{i}]", "each input_extra item is {\"filename\": string, \"text\": string}")
        files.append([chunk.get("filename", "tmp"), chunk["text"]])
    if not texts["prefix"] and not texts["suffix"] and not texts["middle"]:
        raise bad("input_prefix", "nothing to infill: input_prefix, input_suffix and prompt are all empty")
    return {**texts, "extra": files, "repo_level": True}


def _params(body: dict) -> dict:
    if "n_predict" in body and "max_tokens" in body:
        raise bad("n_predict", "give n_predict or max_tokens, not both")
    n = body.get("n_predict", body.get("max_tokens"))
    which = "n_predict" if "n_predict" in body else "max_tokens"
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not (n == -1 or n >= 1)):
        raise bad(which, f"{which} must be -1 (until the model stops or the context ends) or at least 1")
    params = sampling_params({k: v for k, v in body.items() if k in _SAMPLING})
    params["max_tokens"] = -1 if n is None else n
    return params


class Infill:
    def __init__(self, sup, api):
        self.sup, self.api = sup, api

    def on_post(self, req, resp):
        body = self.api.read_json(req)
        known_fields(body, FIELDS)
        if "cache_prompt" in body and not isinstance(body["cache_prompt"], bool):
            raise bad("cache_prompt", "cache_prompt must be a boolean", "invalid_type")
        work = {"infill": infill_work(body), "params": _params(body), **adapter(body), **keep_alive(body)}
        stream = self.api.stream_flag(body)
        route = self.api.route(body, req)
        model = body.get("model") or route["worker"]
        work["worker"] = route["worker"]
        answer = self.api.answer(req, "generate", work, whole=not stream)
        if stream:
            return self.api.send_sse(resp, _events(answer, model, self.api.keepalive), answer)
        content, tokens, final = [], [], None
        try:
            for msg in answer:
                if msg.type == "chunk":
                    content.append(msg.body.get("text", ""))
                    tokens.append(msg.body["token"])
                else:
                    final = msg.body
        except WorkerGone as e:
            raise error_from(e.msg, "input_prefix") from None
        finally:
            answer.close()
        if final is None:
            raise JSONError(499, "client_closed", "the client closed the connection")
        content.append(final.get("text", ""))
        resp.media = _closing(final, model, "".join(content), tokens)


def _closing(final: dict, model: str, content: str, tokens: list[int]) -> dict:
    """llama-server's last completion object: what ended it, the counts and the timings."""
    u, tm = final["usage"], final.get("timings") or {}
    reason = final["finish_reason"]
    stop_type = "limit" if reason == "length" else "word" if final.get("stop_string") is not None else "eos"
    n_prompt = u["prompt_tokens"] - u.get("cached_tokens", 0)
    prefill_ms, decode_ms = 1000 * tm.get("prefill_s", 0.0), 1000 * tm.get("decode_s", 0.0)
    return {"index": 0, "content": content, "tokens": tokens, "stop": True, "model": model,
            "tokens_predicted": u["completion_tokens"], "tokens_evaluated": u["prompt_tokens"],
            "tokens_cached": u.get("cached_tokens", 0), "truncated": False, "stop_type": stop_type,
            "stopping_word": final.get("stop_string") or "", "has_new_line": "\n" in content,
            "timings": {"prompt_n": n_prompt, "prompt_ms": prefill_ms,
                        "prompt_per_second": n_prompt / (prefill_ms / 1000) if prefill_ms else 0.0,
                        "predicted_n": u["completion_tokens"], "predicted_ms": decode_ms,
                        "predicted_per_second": u["completion_tokens"] / (decode_ms / 1000) if decode_ms else 0.0}}


def _events(answer: Answer, model: str, keepalive: float) -> Iterator[bytes]:
    data = lambda obj: b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"  # noqa: E731
    n = 0
    try:
        for msg in answer.stream(keepalive):
            if msg is IDLE:
                yield b": keep-alive\n\n"
                continue
            b = msg.body
            if msg.type == "chunk":
                n += 1
                yield data({"index": 0, "content": b.get("text", ""), "tokens": [b["token"]], "stop": False,
                            "tokens_predicted": n})
            else:
                yield data(_closing(b, model, b.get("text", ""), []))
    except WorkerGone as e:
        yield data(error_from(e.msg, "input_prefix").kiln_body)


def install(app, sup, api) -> None:
    app.add_route("/infill", Infill(sup, api))
