"""OpenAI-compatible routes (and llama-server's /tokenize, /detokenize, /apply-template).

A request is validated here (400 with `param` for a bad field), admitted to its worker's bounded
queue (503 "server busy" beyond `server.max_queue`), sent to the inference worker as a
`generate` op through the supervisor, and answered whole or as server-sent events. A worker
that dies before the first token is retried once, invisibly; a stream already under way ends
with an error event and `[DONE]`; a client that disconnects cancels its request.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from typing import Any, Iterator

import falcon

from kiln.protocol import Message

from .http_app import JSONError, bus

_ROLES = ("system", "user", "assistant", "tool", "developer")
_STATUS = {"bad_request": 400, "context_length_exceeded": 400, "worker_crashed": 502,
           "worker_unavailable": 503, "shutting_down": 503, "deadline_exceeded": 504,
           "unknown_worker": 400, "op_failed": 500, "unknown_op": 500,
           "adapter_not_found": 404, "adapter_mismatch": 400}


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


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad("logprobs", "logprobs must be a boolean", "invalid_type")
        top = _number(body, "top_logprobs", 0, 20, int)
        if top is not None and not lp:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return (top or 0) if lp else None
    return _number(body, "logprobs", 0, 20, int)


def _adapter(body: dict) -> dict:
    """Kiln's extension: "adapter": a registered LoRA for this request ("" for none; absent:
    the active adapter, if one is loaded)."""
    if body.get("adapter") is None:
        return {}
    if not isinstance(body["adapter"], str):
        raise bad("adapter", "adapter must be a string (an adapter name, or \"\" for none)", "invalid_type")
    return {"adapter": body["adapter"]}


def _messages(body: dict) -> list[dict]:
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


# -- talking to the worker ---------------------------------------------------------------------

class WorkerGone(Exception):
    def __init__(self, msg: Message):
        super().__init__(msg.get("message"))
        self.msg = msg


class Admission:
    """Bounded per-worker admission: at most max_queue requests waiting or running."""

    def __init__(self, limit: int):
        self.limit = limit
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def enter(self, worker: str) -> None:
        with self.lock:
            n = self.counts.get(worker, 0)
            if n >= self.limit:
                raise JSONError(503, "server_busy", f"server busy: {n} requests are queued for {worker}; retry later",
                                headers={"Retry-After": "1"})
            self.counts[worker] = n + 1

    def leave(self, worker: str) -> None:
        with self.lock:
            self.counts[worker] -= 1


class _Stream:
    """An SSE body whose close() always releases the request's queue slot — also when the
    server closes it before the first event (a generator that never started runs no finally)."""

    def __init__(self, gen: Iterator[bytes], on_close):
        self.gen, self.on_close = gen, on_close

    def __iter__(self):
        return self.gen

    def close(self) -> None:
        try:
            self.gen.close()
        finally:
            if self.on_close:
                self.on_close()
                self.on_close = None


class OpenAI:
    def __init__(self, sup):
        self.sup = sup
        self.admission = Admission(sup.cfg["server"]["max_queue"])
        self.max_body = sup.cfg["server"]["max_body_bytes"]

    # -- plumbing --

    def read_json(self, req) -> dict:
        if req.content_length is not None and req.content_length > self.max_body:
            raise JSONError(413, "body_too_large",
                            f"request body of {req.content_length} bytes exceeds server.max_body_bytes = {self.max_body}")
        raw = req.bounded_stream.read(self.max_body + 1)
        if len(raw) > self.max_body:
            raise JSONError(413, "body_too_large", f"request body exceeds server.max_body_bytes = {self.max_body}")
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise JSONError(400, "invalid_json", f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise JSONError(400, "invalid_json", "the body must be a JSON object")
        return body

    def inference_workers(self) -> list[dict]:
        return [w for w in bus(self.sup, "status")["workers"] if w["kind"] in ("inference", "moe-stream")]

    def pick(self, body: dict) -> dict:
        workers = self.inference_workers()
        if not workers:
            raise JSONError(503, "no_model", "no inference worker is configured", headers={"Retry-After": "5"})
        model = body.get("model")
        if model is None:
            w = workers[0]
        elif not isinstance(model, str):
            raise bad("model", "model must be a string", "invalid_type")
        else:
            w = next((w for w in workers if model in (w["name"], (w["stats"] or {}).get("model"), w["model"])), None)
            if w is None:
                names = ", ".join(w["name"] for w in workers)
                raise bad("model", f"model {model!r} is not served here (models: {names}; GET /v1/models)",
                          "model_not_found")
        if w["state"] != "running" or w["worker_state"] in ("booting", "loading"):
            loading = w["worker_state"] in ("booting", "loading") and w["state"] in ("starting", "running")
            msg = "loading model" if loading else f"model worker {w['name']} is {w['state']}" + \
                (f": {w['reason']}" if w.get("reason") else "")
            raise JSONError(503, "model_loading" if loading else "worker_unavailable", msg,
                            headers={"Retry-After": "2"})
        return w

    def events(self, worker: str, body: dict, disconnected) -> Iterator[Message]:
        """The worker's messages for one generate request; retries once, invisibly, if the
        worker dies before producing anything; cancels when the client goes away."""
        timeout = self.sup.cfg["server"]["request_timeout"]
        for attempt in (0, 1):
            call = self.sup.call(worker, "generate", body, timeout)
            produced, finished = False, False
            try:
                while True:
                    try:
                        msg = call.events.get(timeout=0.05)
                    except queue.Empty:
                        if disconnected():
                            return
                        continue
                    if msg.type == "chunk":
                        produced = True
                        yield msg
                        if disconnected():
                            return
                        continue
                    finished = True
                    if msg.type == "reply":
                        yield msg
                        return
                    if msg.get("code") == "worker_crashed" and not produced and attempt == 0:
                        self._await_ready(worker, time.monotonic() + min(timeout, 120))
                        break                           # retry once on the restarted worker
                    raise WorkerGone(msg)
            finally:
                if not finished:                        # client gone, or the stream was closed
                    call.cancel()

    def _await_ready(self, worker: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            w = bus(self.sup, "worker", {"name": worker})
            if w["state"] == "running" and w["worker_state"] not in ("booting", "loading"):
                return
            if w["state"] == "fatal":
                return
            time.sleep(0.05)

    @staticmethod
    def _disconnected(req):
        check = req.env.get("waitress.client_disconnected")
        return check if callable(check) else (lambda: False)

    # -- routes --

    def on_get_models(self, req, resp):
        data = []
        for w in self.inference_workers():
            data.append({"id": w["name"], "object": "model", "created": int(time.time()), "owned_by": "kiln",
                         "meta": {"model": (w["stats"] or {}).get("model") or w["model"], "state": w["state"],
                                  "worker_state": w["worker_state"], "n_ctx": (w["stats"] or {}).get("n_ctx")}})
        resp.media = {"object": "list", "data": data}

    def on_post_chat(self, req, resp):
        body = self.read_json(req)
        messages = _messages(body)
        self._generate(req, resp, body, {"messages": messages, **_adapter(body)}, chat=True)

    @staticmethod
    def _prompts(body: dict) -> list[dict]:
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

    def on_post_completions(self, req, resp):
        body = self.read_json(req)
        works = [dict(w, **_adapter(body)) for w in self._prompts(body)]
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise bad("echo", "echo must be a boolean", "invalid_type")
        if echo or len(works) > 1:
            if body.get("stream"):
                raise bad("stream", "stream is not supported with echo or with several prompts")
            return self._batch(req, resp, body, works, echo)
        self._generate(req, resp, body, works[0], chat=False)

    def _batch(self, req, resp, body: dict, works: list[dict], echo: bool) -> None:
        """Non-stream completions for several prompts, optionally echoing each prompt with the
        log-probabilities of its tokens (as evaluation harnesses ask)."""
        params = sampling_params(body, min_tokens=0 if echo else 1)
        lp = _logprobs(body, chat=False)
        if lp is not None:
            params["logprobs"] = lp
        n_gen = params.pop("max_tokens", 16)
        w = self.pick(body)
        name = w["name"]
        self.admission.enter(name)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        try:
            for index, work in enumerate(works):
                pieces, lps, tops, prefix = [], [], [], ""
                if echo:
                    scored = self._one(name, "score", {**work, "top": lp or 0})
                    prefix = work["text"] if "text" in work else self._one(
                        name, "detokenize", {"tokens": work["prompt"]})["text"]
                    pieces, lps = scored["pieces"], scored["token_logprobs"]
                    tops = [None if t is None else {p: v for _, v, p in t} for t in scored["top_logprobs"]]
                    usage["prompt_tokens"] += len(scored["tokens"])
                text, reason = "", "length"
                if n_gen > 0:
                    final = None
                    for msg in self.events(name, dict(work, params=dict(params, max_tokens=n_gen)),
                                           self._disconnected(req)):
                        if msg.type == "chunk":
                            text += msg.body["text"]
                            if lp is not None:
                                pieces.append(msg.body["piece"])
                                lps.append(msg.body["logprob"])
                                tops.append({p: v for _, v, p in msg.body["top_logprobs"]})
                        else:
                            final = msg.body
                    if final is None:
                        raise JSONError(400, "client_closed", "the client closed the connection")
                    text += final["text"]
                    reason = "length" if final["finish_reason"] == "length" else "stop"
                    u = final["usage"]
                    usage["completion_tokens"] += u["completion_tokens"]
                    usage["cached_tokens"] += u["cached_tokens"]
                    if not echo:
                        usage["prompt_tokens"] += u["prompt_tokens"]
                logprobs = None
                if lp is not None:
                    offsets, pos = [], 0
                    for piece in pieces:
                        offsets.append(pos)
                        pos += len(piece)
                    logprobs = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
                choices.append({"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": reason})
        except WorkerGone as e:
            raise self._error(e.msg) from None
        finally:
            self.admission.leave(name)
        resp.media = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
                      "model": body.get("model") or name, "choices": choices, "system_fingerprint": "kiln",
                      "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                                "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]}}}

    def _generate(self, req, resp, body: dict, work: dict, chat: bool) -> None:
        params = sampling_params(body)
        lp = _logprobs(body, chat)
        if lp is not None:
            params["logprobs"] = lp
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream", "stream must be a boolean", "invalid_type")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise bad("stream_options", "stream_options must be an object", "invalid_type")
        include_usage = bool(so.get("include_usage"))
        w = self.pick(body)
        name = w["name"]
        if "max_tokens" not in params:
            params["max_tokens"] = 0          # 0 here means: to the end of the context (below)
        work = dict(work, params=params)
        self.admission.enter(name)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        meta = {"id": rid, "created": created, "model": body.get("model") or name}
        disconnected = self._disconnected(req)
        if params["max_tokens"] == 0:
            params["max_tokens"] = self._remaining(name, work)
        if stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.set_header("X-Accel-Buffering", "no")
            resp.stream = _Stream(self._sse(name, work, meta, chat, include_usage, disconnected),
                                  lambda: self.admission.leave(name))
            return
        try:
            text, toks, final = [], [], None
            for msg in self.events(name, work, disconnected):
                if msg.type == "chunk":
                    text.append(msg.body["text"])
                    toks.append(msg.body)
                else:
                    final = msg.body
            if final is None:
                raise JSONError(400, "client_closed", "the client closed the connection")
            text.append(final["text"])
        except WorkerGone as e:
            raise self._error(e.msg) from None
        finally:
            self.admission.leave(name)
        resp.media = self._whole(meta, chat, "".join(text), toks, final, lp is not None)

    def _remaining(self, worker: str, work: dict) -> int:
        w = bus(self.sup, "worker", {"name": worker})
        n_ctx = (w["stats"] or {}).get("n_ctx") or 2048
        n_prompt = len(work["prompt"]) if "prompt" in work else 0
        if not n_prompt:
            n_prompt = self._count_prompt(worker, work)
        return max(1, n_ctx - n_prompt)

    def _count_prompt(self, worker: str, work: dict) -> int:
        op, body = (("apply_template", {"messages": work["messages"]}) if "messages" in work
                    else ("tokenize", {"text": work["text"], "special": True}))
        reply = self._one(worker, op, body)
        return len(reply["tokens"])

    def _one(self, worker: str, op: str, body: dict) -> dict:
        call = self.sup.call(worker, op, body, 60)
        try:
            msg = call.events.get(timeout=65)
        except queue.Empty:
            raise JSONError(504, "timeout", f"{op} timed out") from None
        if msg.type == "error":
            raise self._error(msg)
        return msg.body

    def _error(self, msg: Message) -> JSONError:
        code = msg.get("code") or "error"
        status = _STATUS.get(code, 500)
        headers = {"Retry-After": "2"} if status == 503 else None
        extra = {"param": "messages"} if code == "context_length_exceeded" else {}
        return JSONError(status, code, msg.get("message") or code, headers=headers, **extra)

    # -- response shapes --

    @staticmethod
    def _usage(final: dict) -> dict:
        u = final["usage"]
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    @staticmethod
    def _chat_logprobs(toks: list[dict]) -> dict:
        return {"content": [{"token": t["piece"], "logprob": t["logprob"], "bytes": list(t["piece"].encode()),
                             "top_logprobs": [{"token": p, "logprob": l, "bytes": list(p.encode())}
                                              for _, l, p in t["top_logprobs"]]} for t in toks]}

    @staticmethod
    def _completion_logprobs(toks: list[dict]) -> dict:
        offsets, pos = [], 0
        for t in toks:
            offsets.append(pos)
            pos += len(t["piece"])
        return {"tokens": [t["piece"] for t in toks], "token_logprobs": [t["logprob"] for t in toks],
                "top_logprobs": [{p: l for _, l, p in t["top_logprobs"]} for t in toks], "text_offset": offsets}

    def _whole(self, meta, chat, text, toks, final, with_lp) -> dict:
        reason = "length" if final["finish_reason"] == "length" else "stop"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._chat_logprobs(toks) if with_lp else None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self._completion_logprobs(toks) if with_lp else None,
                      "finish_reason": reason}
            obj = "text_completion"
        return {**meta, "object": obj, "choices": [choice], "usage": self._usage(final),
                "system_fingerprint": "kiln"}

    def _sse(self, worker, work, meta, chat, include_usage, disconnected) -> Iterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        with_lp = "logprobs" in work["params"]

        def event(choice: dict | None, **extra) -> bytes:
            payload = {**meta, "object": obj, "choices": [choice] if choice else [], **extra}
            return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

        try:
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            for msg in self.events(worker, work, disconnected):
                if msg.type == "chunk":
                    t = msg.body
                    if not t["text"] and not with_lp:
                        continue
                    if chat:
                        yield event({"index": 0, "delta": {"content": t["text"]},
                                     "logprobs": self._chat_logprobs([t]) if with_lp else None, "finish_reason": None})
                    else:
                        yield event({"index": 0, "text": t["text"],
                                     "logprobs": self._completion_logprobs([t]) if with_lp else None,
                                     "finish_reason": None})
                    continue
                final = msg.body
                reason = "length" if final["finish_reason"] == "length" else "stop"
                if chat:
                    if final["text"]:
                        yield event({"index": 0, "delta": {"content": final["text"]}, "logprobs": None,
                                     "finish_reason": None})
                    yield event({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason})
                else:
                    yield event({"index": 0, "text": final["text"], "logprobs": None, "finish_reason": reason})
                if include_usage:
                    yield event(None, usage=self._usage(final))
            yield b"data: [DONE]\n\n"
        except WorkerGone as e:
            err = self._error(e.msg).kiln_body
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

    def on_post_tokenize(self, req, resp):
        body = self.read_json(req)
        text = body.get("content", body.get("prompt"))
        if not isinstance(text, str):
            raise bad("content", "content (or prompt) must be a string", "invalid_type")
        w = self.pick(body)
        special = body.get("parse_special", body.get("add_special", False))
        resp.media = {"tokens": self._one(w["name"], "tokenize", {"text": text, "special": bool(special)})["tokens"]}

    def on_post_detokenize(self, req, resp):
        body = self.read_json(req)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise bad("tokens", "tokens must be a list of token ids", "invalid_type")
        w = self.pick(body)
        text = self._one(w["name"], "detokenize", {"tokens": toks})["text"]
        resp.media = {"content": text, "prompt": text}

    def on_post_template(self, req, resp):
        body = self.read_json(req)
        w = self.pick(body)
        out = self._one(w["name"], "apply_template", {"messages": _messages(body)})
        resp.media = {"prompt": out["prompt"], "tokens": out["tokens"]}

    def on_get_tokenizer_info(self, req, resp):
        w = self.pick({"model": req.get_param("model")} if req.get_param("model") else {})
        info = self._one(w["name"], "info", {})
        resp.media = {k: info[k] for k in ("bos_token", "eos_token", "chat_template", "vocab_size", "n_ctx")}


def install(app: falcon.App, sup) -> "OpenAI":
    api = OpenAI(sup)
    app.add_route("/v1/models", api, suffix="models")
    app.add_route("/v1/chat/completions", api, suffix="chat")
    app.add_route("/v1/completions", api, suffix="completions")
    app.add_route("/tokenize", api, suffix="tokenize")
    app.add_route("/detokenize", api, suffix="detokenize")
    app.add_route("/apply-template", api, suffix="template")
    app.add_route("/tokenizer_info", api, suffix="tokenizer_info")
    return api
