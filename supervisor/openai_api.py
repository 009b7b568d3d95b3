"""OpenAI-compatible routes.

A route validates its body (supervisor/openai_validate.py: 400 naming the field), asks the
router which worker serves the model (`route`: 400 for a model not served, 503 without
Retry-After for a fatal worker), then hands the work to the router as a routed op and translates
its messages back (supervisor/openai_shapes.py). Admission, waiting through a worker's restart,
retrying a request that produced nothing and deadlines are the router's: a 503 comes only when
its queue is full or the worker did not come back within `server.wait_for_worker`. A stream
already under way when its worker dies ends with an error event and `[DONE]`; a client that
disconnects cancels its request.
"""

from __future__ import annotations

import base64
import queue
import os
import time
import uuid
from typing import Iterator

import falcon
import numpy as np

from kiln.protocol import Message

from kiln.protocol import vocab

from . import openai_shapes as shapes
from .http_common import JSONError, bus, error_from, parse_json, routed
from .request_paths import check_model_ref
from .llama_fields import FIELDS as LLAMA_FIELDS, llama_params
from .openai_validate import (CHAT_FIELDS, COMPLETION_FIELDS, EMBEDDING_FIELDS, adapter, embedding_inputs, grammar, keep_alive, bad, known_fields, logprobs, messages,
                              prompts, sampling_params, tools)


class WorkerGone(Exception):
    def __init__(self, msg: Message):
        super().__init__(msg.get("message"))
        self.msg = msg


IDLE = object()      # Answer.stream(idle=…): nothing came for that long (time for a keep-alive)
FIRST_WAIT = 2.0     # a stream starts after this long without its first message (a long prefill)


class Answer:
    """The messages of one routed request, read by an HTTP thread. The first one is awaited
    before the response starts, so that a refusal (queue full, worker gone, a bad request) is an
    HTTP status — for a stream, up to `first_wait` seconds: refusals come within milliseconds,
    while a long prompt's prefill may take minutes, and a client that hears nothing for that
    long gives up (Claude Code after 300 s). A later error is the stream's error event."""

    def __init__(self, sup, op: str, body: dict, disconnected, seen=lambda msg: None, whole: bool = False,
                 first_wait: float | None = None):
        # whole: the caller answers only once it has everything (not streamed), so the router may
        # rerun the request when its worker dies after output — what came before is dropped
        self.call = sup.request(op, body, replayable=whole)
        self.whole = whole
        self.disconnected = disconnected
        self.seen = seen                       # timing and usage, for the request log and metrics
        self.finished = False
        self.first = self._next(first_wait)

    def _next(self, idle: float | None = None):
        """The next message; None once the client is gone; IDLE after `idle` seconds of nothing."""
        until = time.monotonic() + idle if idle is not None else None
        while True:
            try:
                msg = self.call.events.get(timeout=0.05)
            except queue.Empty:
                if self.disconnected():
                    self.close()
                    return None
                if until is not None and time.monotonic() >= until:
                    return IDLE
                continue
            if msg.type not in ("chunk", "restart"):
                self.finished = True
            return msg

    def __iter__(self) -> Iterator[Message]:
        if self.whole:
            yield from self._kept()
            return
        yield from (m for m in self.stream() if m is not IDLE)

    def stream(self, idle: float | None = None) -> Iterator:
        """The messages as they come — and IDLE after each `idle` seconds of silence."""
        msg = self.first
        while msg is not None:
            if msg is IDLE:
                yield IDLE
                msg = self._next(idle)
                continue
            if msg.type == "error":
                raise WorkerGone(msg)
            self.seen(msg)
            yield msg
            if msg.type == "reply" or self.disconnected():
                return
            msg = self._next(idle)

    def _kept(self) -> list[Message]:
        """Every message of the last run, once the reply came: a "restart" (the worker died after
        output; the router runs the request again) drops what came before it."""
        kept, msg = [], self.first
        while msg is not None:
            if msg.type == "error":
                raise WorkerGone(msg)
            if msg.type == "restart":
                kept = []
            else:
                self.seen(msg)
                kept.append(msg)
                if msg.type == "reply":
                    return kept
            if self.disconnected():
                return []
            msg = self._next()
        return []

    def close(self) -> None:
        if not self.finished:                  # client gone, or the stream was closed
            self.finished = True
            self.call.cancel()


class _Stream:
    """An SSE body whose close() always cancels the request — also when the server closes it
    before the first event (a generator that never started runs no finally)."""

    def __init__(self, gen: Iterator[bytes], answer: Answer):
        self.gen, self.answer = gen, answer

    def __iter__(self):
        return self.gen

    def close(self) -> None:
        try:
            self.gen.close()
        finally:
            self.answer.close()


class OpenAI:
    def __init__(self, sup, metrics=None):
        self.sup = sup
        self.metrics = metrics
        self.max_body = sup.cfg["server"]["max_body_bytes"]
        self.keepalive = sup.cfg["server"]["stream_keepalive"]     # seconds of silence before a keep-alive

    # -- plumbing --

    def read_json(self, req) -> dict:
        if req.content_length is not None and req.content_length > self.max_body:
            raise JSONError(413, "body_too_large",
                            f"request body of {req.content_length} bytes exceeds server.max_body_bytes = {self.max_body}")
        raw = req.bounded_stream.read(self.max_body + 1)
        if len(raw) > self.max_body:
            raise JSONError(413, "body_too_large", f"request body exceeds server.max_body_bytes = {self.max_body}")
        return parse_json(raw)

    def route(self, body: dict, req=None) -> dict:
        """The worker that serves body["model"] (the default model when absent), from the router."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("model", "model must be a string", "invalid_type")
        check_model_ref(self.sup, model)
        try:
            r = self.sup.command("route", {"model": model} if model else {})
        except Exception as e:  # noqa: BLE001 - a CommandError, shaped below
            code = getattr(e, "code", "internal_error")
            if code == "model_not_found":
                raise bad("model", e.message, "model_not_found") from None
            raise JSONError(getattr(e, "status", 500), code, getattr(e, "message", str(e))) from None
        if req is not None:
            req.context.model = r["worker"]
        if r["bad_model_file"]:
            raise bad("model", f"model {r['worker']} cannot be loaded: {r['reason']}", "model_invalid")
        if r["state"] == vocab.FATAL:
            raise JSONError(503, "worker_fatal", f"worker {r['worker']} is fatal: {r['reason']}; fix its "
                            f"configuration, then `kiln restart {r['worker']}`")
        return r

    def _observer(self, req):
        """Records time to first token and inter-token gaps as chunks arrive, usage at the end."""
        last = [None]

        def seen(msg):
            now = time.perf_counter()
            if msg.type == "chunk" and "token" in msg.body:
                if req.context.ttft is None:
                    req.context.ttft = now - req.context.t0
                elif last[0] is not None and self.metrics is not None:
                    self.metrics.gap.observe(now - last[0])
                last[0] = now
            elif msg.type == "reply" and isinstance(msg.body.get("usage"), dict):
                u, prev = msg.body["usage"], req.context.usage or {}
                req.context.usage = {k: prev.get(k, 0) + u.get(k, 0) for k in ("prompt_tokens", "completion_tokens",
                                                                               "draft_tokens", "accepted_tokens")}
        return seen

    def answer(self, req, op: str, body: dict, whole: bool = False) -> Answer:
        """`whole`: the response is sent once the answer is complete (not streamed); a stream
        starts after FIRST_WAIT seconds without its first message (Answer)."""
        a = Answer(self.sup, op, body, self._disconnected(req), self._observer(req), whole,
                   None if whole else min(FIRST_WAIT, self.keepalive))
        if a.first is None:
            raise JSONError(499, "client_closed", "the client closed the connection")
        if a.first is not IDLE and a.first.type == "error":
            raise error_from(a.first, _param(body))
        return a

    @staticmethod
    def stream_flag(body: dict) -> bool:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream", "stream must be a boolean", "invalid_type")
        return stream

    @staticmethod
    def send_sse(resp, events: Iterator[bytes], answer: Answer) -> None:
        """Answer with a server-sent event stream (unbuffered by proxies; closing it cancels)."""
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")
        resp.stream = _Stream(events, answer)

    def _one(self, op: str, body: dict) -> dict:
        return routed(self.sup, op, body, 60)

    @staticmethod
    def _disconnected(req):
        check = req.env.get("waitress.client_disconnected")
        return check if callable(check) else (lambda: False)

    # -- routes --

    def on_get_models(self, req, resp):
        resp.media = {"object": "list", "data": self._models()}

    def on_get_model(self, req, resp, model):
        """One model of the list (`client.models.retrieve`): a served model or a library one."""
        found = next((m for m in self._models() if m["id"] == model), None)
        if found is None:
            raise JSONError(404, "model_not_found", f"model {model!r} is neither served nor in the library "
                            f"(GET /v1/models lists them)")
        resp.media = found

    def _models(self) -> list[dict]:
        data, workers = [], bus(self.sup, "status")["workers"]
        for w in workers:
            if w["kind"] not in ("inference", "moe-stream"):
                continue
            data.append({"id": w["name"], "object": "model", "created": int(time.time()), "owned_by": "kiln",
                         "meta": {"model": (w["stats"] or {}).get("model") or w["model"], "state": w["state"],
                                  "worker_state": w["worker_state"], "n_ctx": (w["stats"] or {}).get("n_ctx"),
                                  "loaded": w["pid"] is not None}})          # a stopped worker holds none
        # the library: a request naming any of these loads it (a file a worker serves, or is
        # still loading, is listed once: as its worker)
        served = {d["id"] for d in data} | {str(d["meta"]["model"] or "").rsplit("/", 1)[-1].removesuffix(".gguf")
                                            for d in data}
        files = {f for f in map(_served_file, workers) if f}
        for m in bus(self.sup, "library")["models"]:
            if m["name"] not in served and _real(m["path"]) not in files:
                data.append({"id": m["name"], "object": "model", "created": int(m["modified"]), "owned_by": "kiln",
                             "meta": {"model": m["path"], "loaded": False, "size_bytes": m["size_bytes"]}})
        return data

    def on_post_chat(self, req, resp):
        body = self.read_json(req)
        known_fields(body, CHAT_FIELDS | LLAMA_FIELDS)
        self._generate(req, resp, body, {"messages": messages(body), **tools(body), **grammar(body), **adapter(body),
                                         **keep_alive(body)}, chat=True)

    def on_post_completions(self, req, resp):
        body = self.read_json(req)
        known_fields(body, COMPLETION_FIELDS | LLAMA_FIELDS)
        works = [dict(w, **grammar(body), **adapter(body), **keep_alive(body)) for w in prompts(body)]
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise bad("echo", "echo must be a boolean", "invalid_type")
        if echo or len(works) > 1:
            if body.get("stream"):
                raise bad("stream", "stream is not supported with echo or with several prompts")
            if body.get("n", 1) != 1:
                raise bad("n", "n > 1 is not supported with echo or with several prompts")
            return self._batch(req, resp, body, works, echo)
        self._generate(req, resp, body, works[0], chat=False)

    def _batch(self, req, resp, body: dict, works: list[dict], echo: bool) -> None:
        """Non-stream completions for several prompts, optionally echoing each prompt with the
        log-probabilities of its tokens (as evaluation harnesses ask)."""
        params = {**sampling_params(body, min_tokens=0 if echo else 1), **llama_params(body)}
        lp = logprobs(body, chat=False)
        if lp is not None:
            params["logprobs"] = lp
        n_gen = params.pop("max_tokens", 16)
        name = self.route(body, req)["worker"]
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        try:
            for index, work in enumerate(works):
                pieces, lps, tops, prefix = [], [], [], ""
                if echo:
                    scored = self._one("score", {**work, "top": lp or 0, "worker": name})
                    prefix = work["text"] if "text" in work else self._one(
                        "detokenize", {"tokens": work["prompt"], "worker": name})["text"]
                    pieces, lps = scored["pieces"], scored["token_logprobs"]
                    tops = [None if t is None else {p: v for _, v, p in t} for t in scored["top_logprobs"]]
                    usage["prompt_tokens"] += len(scored["tokens"])
                text, reason = "", "length"
                if n_gen > 0:
                    final = None
                    answer = self.answer(req, "generate", dict(work, params=dict(params, max_tokens=n_gen),
                                                               worker=name), whole=True)
                    for msg in answer:
                        if msg.type == "chunk":
                            text += msg.body["text"]
                            if lp is not None:
                                pieces.append(msg.body["piece"])
                                lps.append(msg.body["logprob"])
                                tops.append({p: v for _, v, p in msg.body["top_logprobs"]})
                        else:
                            final = msg.body
                    if final is None:
                        raise JSONError(499, "client_closed", "the client closed the connection")
                    text += final["text"]
                    reason = "length" if final["finish_reason"] == "length" else "stop"
                    u = final["usage"]
                    usage["completion_tokens"] += u["completion_tokens"]
                    usage["cached_tokens"] += u["cached_tokens"]
                    if not echo:
                        usage["prompt_tokens"] += u["prompt_tokens"]
                lps_out = None
                if lp is not None:
                    offsets, pos = [], 0
                    for piece in pieces:
                        offsets.append(pos)
                        pos += len(piece)
                    lps_out = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
                choices.append({"index": index, "text": prefix + text, "logprobs": lps_out, "finish_reason": reason})
        except WorkerGone as e:
            raise error_from(e.msg, "prompt") from None
        resp.media = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
                      "model": body.get("model") or name, "choices": choices, "system_fingerprint": "kiln",
                      "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                                "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]}}}

    def _generate(self, req, resp, body: dict, work: dict, chat: bool) -> None:
        params = {**sampling_params(body, unbounded=True), **llama_params(body)}
        lp = logprobs(body, chat)
        if lp is not None:
            params["logprobs"] = lp
        stream = self.stream_flag(body)
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise bad("stream_options", "stream_options must be an object", "invalid_type")
        include_usage = bool(so.get("include_usage"))
        n = params.get("n", 1)
        name = self.route(body, req)["worker"]
        params.setdefault("max_tokens", -1)        # -1: to the end of the context (the worker knows it)
        work = dict(work, params=params, worker=name)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "created": int(time.time()), "model": body.get("model") or name}
        answer = self.answer(req, "generate", work, whole=not stream)
        if stream:
            return self.send_sse(resp, self._sse(answer, shapes.StreamShapes(meta, chat, lp is not None, n),
                                                 include_usage, self.keepalive), answer)
        choices = [shapes.Choice(i) for i in range(n)]
        try:
            final = None
            for msg in answer:
                if msg.type == "chunk":
                    choices[msg.body.get("index", 0)].add(msg.body)
                else:
                    final = msg.body
            if final is None:
                raise JSONError(499, "client_closed", "the client closed the connection")
        except WorkerGone as e:
            raise error_from(e.msg, _param(work)) from None
        finally:
            answer.close()
        for f in final.get("choices", [final]):
            choices[f.get("index", 0)].close(f)
        resp.media = shapes.whole(meta, chat, choices, final, lp is not None)

    @staticmethod
    def _sse(answer: Answer, s: shapes.StreamShapes, include_usage: bool, keepalive: float) -> Iterator[bytes]:
        try:
            yield from s.opening()
            for msg in answer.stream(keepalive):
                if msg is IDLE:
                    yield b": keep-alive\n\n"           # an SSE comment: clients skip it
                    continue
                if msg.type == "chunk":
                    yield from s.part(msg.body)
                else:
                    yield from s.closing(msg.body.get("choices", [msg.body]), msg.body, include_usage)
            yield shapes.sse("[DONE]")
        except WorkerGone as e:
            yield shapes.sse(error_from(e.msg, "messages" if s.chat else "prompt").kiln_body)
            yield shapes.sse("[DONE]")

    def on_post_embeddings(self, req, resp):
        body = self.read_json(req)
        known_fields(body, EMBEDDING_FIELDS)
        inputs = embedding_inputs(body)
        name = self.route(body, req)["worker"]
        work = {"inputs": inputs, "worker": name, **adapter(body), **keep_alive(body)}
        if body.get("dimensions") is not None:
            work["dimensions"] = body["dimensions"]
        out = routed(self.sup, "embed", work, 600, "input")
        req.context.usage = {"prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": 0}
        b64 = body.get("encoding_format") == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v).decode() if b64 else np.frombuffer(v, "<f4").tolist()}
                for i, v in enumerate(out["embeddings"])]
        n = out["usage"]["prompt_tokens"]
        resp.media = {"object": "list", "data": data, "model": body.get("model") or name,
                      "usage": {"prompt_tokens": n, "total_tokens": n}}


def _real(path: str) -> str:
    """A path compared as the placer compares it: absolute, links not followed (two library
    names linked to one file are two models, as their owner named them)."""
    return os.path.abspath(path)


def _served_file(w: dict) -> str | None:
    """The file a model worker serves: from its stats once loaded, its spec's model before."""
    if w["kind"] not in ("inference", "moe-stream"):
        return None
    path = (w["stats"] or {}).get("path")
    if path:
        return _real(path)
    from kiln.native.models.library import ModelNotFound, resolve_model
    try:
        return _real(str(resolve_model(str(w["model"]))))
    except (ModelNotFound, OSError, ValueError):
        return None


def _param(work: dict) -> str:
    """The request field a generation's input came in: chat messages, or a completion's prompt."""
    return "messages" if "messages" in work else "prompt"


def install(app: falcon.App, sup, metrics=None) -> "OpenAI":
    api = OpenAI(sup, metrics)
    app.add_route("/v1/models", api, suffix="models")
    app.add_route("/v1/models/{model}", api, suffix="model")
    app.add_route("/v1/chat/completions", api, suffix="chat")
    app.add_route("/v1/completions", api, suffix="completions")
    app.add_route("/v1/embeddings", api, suffix="embeddings")
    return api
