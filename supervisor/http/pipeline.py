"""One generation's way through the HTTP edge, the same for every dialect.

    body ─► dialect.to_work ─► Work ─► router (one trip through the loop: admitted, or refused)
         ─► stream: Shape.opening, part…, closing — or a keep-alive in a silence, failed if the worker is lost
         ─► whole: every part collected, Shape.whole

A dialect module supplies only its translation (`to_work`: body → Work) and a `Shape` (how its
answer is said). Everything between is here, once: the first message awaited so that a refusal
is an HTTP status, a client gone (499), a worker lost before or during the answer, the request
log's model, time to first token and usage.
"""

from __future__ import annotations

import queue
import time
from typing import Iterable, Iterator

from kiln.protocol import Message

from .common import JSONError, answer_of, error_from, parse_json
from .request_paths import check_model_ref
from .work import Work, apply_created

IDLE = object()      # Answer.stream(idle=…): nothing came for that long (time for a keep-alive)
FIRST_WAIT = 2.0     # a stream starts after this long without its first message (a long prefill)


class WorkerGone(Exception):
    def __init__(self, msg: Message):
        super().__init__(msg.get("message"))
        self.msg = msg


class Answer:
    """The messages of one routed request, read by an HTTP thread. The router's "admitted" comes
    first (the worker that took it); then the first answer is awaited before the response starts,
    so that a refusal (queue full, worker gone, a bad request) is an HTTP status — for a stream, up
    to `first_wait` seconds: refusals come within milliseconds, while a long prompt's prefill may
    take minutes, and a client that hears nothing for that long gives up (Claude Code after 300 s).
    A later error is the stream's error event."""

    def __init__(self, sup, op: str, body: dict, disconnected, seen=lambda msg: None, whole: bool = False,
                 first_wait: float | None = None):
        # whole: the caller answers only once it has everything (not streamed), so the router may
        # rerun the request when its worker dies after output — what came before is dropped
        self.call = sup.router.request(op, body, replayable=whole, admission=True)
        self.whole = whole
        self.disconnected = disconnected
        self.seen = seen                       # timing and usage, for the request log and metrics
        self.finished = False
        self.worker: str | None = None         # who took it (the router's "admitted")
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
            if msg.type == "admitted":
                self.worker = msg.get("worker")
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


class Stream:
    """A streamed body whose close() always cancels the request — also when the server closes it
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


class Shape:
    """How a dialect says one generation's answer. `start` learns the model the answer names;
    a stream is opening, a part per chunk, closing for the reply (or failed when the worker is
    lost mid-answer); a whole answer is `whole` of every part and the reply."""

    media = "text/event-stream"
    keepalive: bytes | None = b": keep-alive\n\n"     # said in a silence (a long prefill); None: nothing
    param = "messages"                                 # the request field its input came in

    def start(self, model: str) -> None:
        self.model = model

    def opening(self) -> Iterable[bytes]:
        return ()

    def part(self, chunk: dict) -> Iterable[bytes]:
        raise NotImplementedError

    def closing(self, final: dict) -> Iterable[bytes]:
        raise NotImplementedError

    def failed(self, err: JSONError) -> Iterable[bytes]:
        raise NotImplementedError

    def whole(self, parts: list[dict], final: dict) -> dict:
        raise NotImplementedError

    def refused(self, err: JSONError) -> JSONError:
        """A refusal before any answer, as this dialect names its fields."""
        return err


class Pipeline:
    """The HTTP edge's way to the router: bodies in, routed requests, answers out."""

    def __init__(self, sup, metrics=None):
        self.sup = sup
        self.metrics = metrics
        self.max_body = sup.cfg["server"]["max_body_bytes"]
        self.keepalive = sup.cfg["server"]["stream_keepalive"]     # seconds of silence before a keep-alive

    def read_json(self, req) -> dict:
        if req.content_length is not None and req.content_length > self.max_body:
            raise JSONError(413, "body_too_large",
                            f"request body of {req.content_length} bytes exceeds server.max_body_bytes = {self.max_body}")
        raw = req.bounded_stream.read(self.max_body + 1)
        if len(raw) > self.max_body:
            raise JSONError(413, "body_too_large", f"request body exceeds server.max_body_bytes = {self.max_body}")
        return parse_json(raw)

    def generate(self, req, resp, work: Work, shape: Shape, stream: bool) -> None:
        """Run `work` and answer in `shape`: streamed, or whole once the reply came. A created
        model's base was checked when it was created (its manifest is the user's own file)."""
        created = apply_created(work)
        answer = self.answer(req, "generate", work.body(), whole=not stream, shape=shape, checked=created is not None)
        shape.start(created or work.model or answer.worker or "default")
        if stream:
            resp.content_type = shape.media
            resp.set_header("Cache-Control", "no-cache")
            resp.set_header("X-Accel-Buffering", "no")          # unbuffered by proxies
            resp.stream = Stream(self._frames(answer, shape), answer)
            return
        parts, final = [], None
        try:
            for msg in answer:
                if msg.type == "chunk":
                    parts.append(msg.body)
                else:
                    final = msg.body
        except WorkerGone as e:
            raise shape.refused(error_from(e.msg, shape.param)) from None
        finally:
            answer.close()
        if final is None:
            raise JSONError(499, "client_closed", "the client closed the connection")
        resp.media = shape.whole(parts, final)

    def _frames(self, answer: Answer, shape: Shape) -> Iterator[bytes]:
        try:
            yield from shape.opening()
            for msg in answer.stream(self.keepalive if shape.keepalive else None):
                if msg is IDLE:
                    yield shape.keepalive
                elif msg.type == "chunk":
                    yield from shape.part(msg.body)
                else:
                    yield from shape.closing(msg.body)
        except WorkerGone as e:
            yield from shape.failed(error_from(e.msg, shape.param))

    def answer(self, req, op: str, body: dict, whole: bool = False, shape: Shape | None = None,
               checked: bool = False, stop=None) -> Answer:
        """A routed request's Answer, its first message in: a refusal is raised as the HTTP error.
        `whole`: the response is sent once the answer is complete (not streamed); a stream starts
        after FIRST_WAIT seconds without its first message. `checked`: the model reference is
        known to be allowed. `stop`: another reason to give up on it (a batch's other prompt failed)."""
        model = body.get("model")
        if model is not None and not checked:
            check_model_ref(self.sup, model)
        gone = _disconnected(req)
        a = Answer(self.sup, op, body, gone if stop is None else (lambda: gone() or stop()), self._observer(req), whole,
                   None if whole else min(FIRST_WAIT, self.keepalive))
        req.context.model = a.worker or req.context.get("model")
        if a.first is None:
            raise JSONError(499, "client_closed", "the client closed the connection")
        if a.first is not IDLE and a.first.type == "error":
            err = refusal(a.first, "messages" if "messages" in body else "prompt")
            raise shape.refused(err) if shape is not None else err
        return a

    def call(self, req, op: str, body: dict, timeout: float = 60, param: str = "messages",
             shape: Shape | None = None) -> tuple[dict, str]:
        """One routed op that is not a generation (tokenize, score, embed, apply_template, info):
        (its reply body, the worker that answered), or its error as the HTTP error."""
        model = body.get("model")
        if model is not None:
            check_model_ref(self.sup, model)
        msg = answer_of(self.sup.router.request(op, body, timeout), op, timeout)
        if msg.type == "error":
            err = refusal(msg, param)
            raise shape.refused(err) if shape is not None else err
        req.context.model = msg.get("worker") or req.context.get("model")
        return msg.body, msg.get("worker")

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


def refusal(msg: Message, param: str) -> JSONError:
    """A router's or worker's refusal as the HTTP error: a model that is not served or cannot be
    loaded is the request's `model` field's fault (400)."""
    code = msg.get("code")
    if code in ("model_not_found", "model_invalid"):
        return JSONError(400, code, msg.get("message") or code, param="model")
    return error_from(msg, param)


def _disconnected(req):
    check = req.env.get("waitress.client_disconnected")
    return check if callable(check) else (lambda: False)


def stream_flag(body: dict, default: bool = False) -> bool:
    stream = body.get("stream", default)
    if not isinstance(stream, bool):
        from .openai_validate import bad
        raise bad("stream", "stream must be a boolean", "invalid_type")
    return stream
