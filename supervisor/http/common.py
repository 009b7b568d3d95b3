"""What every HTTP route module shares: the JSON error shape, and the two ways a route reaches
the supervisor — a bus command (`bus`) or a routed op (`routed`, `error_from`)."""

from __future__ import annotations

import json
import os
import queue

import falcon

from kiln.protocol.vocab import http_status

from ..core.registry import CommandError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error", 499: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 502: "server_error", 503: "server_error", 504: "server_error"}


def error_body(status: int, code: str, message: str, **extra) -> dict:
    return {"error": {"code": code, "type": _TYPES.get(status, "server_error"), "message": message, **extra}}


class JSONError(falcon.HTTPError):
    def __init__(self, status: int, code: str, message: str, headers: dict | None = None, **extra):
        super().__init__(falcon.code_to_http_status(status), headers=headers)
        self.kiln_body = error_body(status, code, message, **extra)


MAX_DEPTH = 64       # no API body nests deeper (tools' JSON schemas reach ~20)


def ndjson(obj: dict) -> bytes:
    """One line of a newline-delimited JSON stream (Ollama's)."""
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def parse_json(raw: bytes, top: type | tuple = dict):
    """A request body as a JSON object (or `top`: llama-server's /lora-adapters takes a list), or a
    400 that says what is wrong with it: not JSON, not an object, nested deeper than MAX_DEPTH, or a
    string that is not text (a lone UTF-16 surrogate, which JSON's \\u escapes can spell but
    nothing downstream can encode)."""
    try:
        body = json.loads(raw or b"null", parse_constant=_no_constant)
    except RecursionError:
        raise JSONError(400, "invalid_json", f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise JSONError(400, "invalid_json", f"the body is not valid JSON: {e}") from None
    if not isinstance(body, top):
        raise JSONError(400, "invalid_json", "the body must be a JSON " + ("object" if top is dict else "array"))
    stack = [(body, "", 1)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise JSONError(400, "invalid_json", f"the body nests deeper than {MAX_DEPTH} levels "
                            f"(at {where.lstrip('.')[:120]}…)")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            # a key may itself be the bad string: the path is kept printable
            at = f"{where}.{_printable(k)}" if isinstance(k, str) else f"{where}[{k}]"
            for s in ((k, v) if isinstance(k, str) else (v,)):
                if isinstance(s, str) and not _is_text(s):
                    raise JSONError(400, "invalid_text", f"{at.lstrip('.')} holds a lone UTF-16 surrogate "
                                    f"(\\ud800-\\udfff without its pair): not text", param=at.lstrip("."))
            if type(v) is int and not -2**63 <= v < 2**64:     # past what any field means (and msgpack carries)
                raise JSONError(400, "invalid_value", f"{at.lstrip('.')} = {str(v)[:40]}… is out of range",
                                param=at.lstrip("."))
            if isinstance(v, (dict, list)):
                stack.append((v, at, depth + 1))
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def _printable(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def action_body(req, allowed: tuple[str, ...] = ()) -> dict:
    """The body of an action route (restart, load, unload, cancel): none, `{}`, or only the
    `allowed` fields — anything else is a 400 naming it, not a field quietly ignored."""
    raw = req.bounded_stream.read(1 << 16)
    if not raw.strip():
        return {}
    body = parse_json(raw)
    for k in body:
        if k not in allowed:
            takes = f"takes only {', '.join(allowed)}" if allowed else "takes no fields"
            raise JSONError(400, "unsupported_field", f"{req.method} {req.path} {takes}; got {k!r}", param=k)
    return body


def bus(sup, name: str, args: dict | None = None):
    try:
        return sup.command(name, args or {})
    except CommandError as e:
        raise JSONError(e.status, e.code, e.message) from None


def error_from(msg, param: str = "messages") -> JSONError:
    """A router or worker `error` message as the HTTP error users read: the status from the
    shared vocabulary, Retry-After only where retrying can help. `param`: the request field a
    too-long input came in (messages, prompt, input)."""
    code = msg.get("code") or "error"
    status = http_status(code)
    headers = None
    if msg.get("retry_after") is not None:
        headers = {"Retry-After": str(max(1, round(float(msg.get("retry_after")))))}
    extra = {"param": param} if code == "context_length_exceeded" else {}
    return JSONError(status, code, msg.get("message") or code, headers=headers, **extra)


def routed(sup, op: str, body: dict, timeout: float = 600, param: str = "messages") -> dict:
    """One routed op (train.submit, eval.cancel, tokenize, …) through the router: its reply body,
    or its error as a JSONError."""
    msg = answer_of(sup.router.request(op, body, timeout), op, timeout)
    if msg.type == "error":
        raise error_from(msg, param)
    return msg.body


def answer_of(call, op: str, timeout: float):
    """The one message answering a call that is not streamed (its reply or error); a 504 when
    none came in time (the call cancelled: the worker stops working for nobody)."""
    try:
        return call.events.get(timeout=timeout + 5)
    except queue.Empty:
        call.cancel()
        raise JSONError(504, "timeout", f"{op} was not answered within {timeout:g} s") from None


def context_notes(final: dict) -> dict:
    """Kiln's word on what was done to fit the context, if anything was: `truncation: "auto"`
    (Ollama's truncate) dropped the oldest messages (truncated_messages: how many), and the
    context shifted during the answer (context_shifts: how often)."""
    return {k: final[k] for k in ("truncated_messages", "context_shifts") if final.get(k)}


def token_logprobs(chunks: list[dict], ids: bool = False) -> list[dict]:
    """Each generated token's log-probability entry, as OpenAI, Ollama, the Responses API and
    llama-server (`ids`: with the token ids) give them: its text, bytes, logprob and alternatives.
    Chunks without a logprob (text held back, a final) have none."""
    def entry(token: str, lp: float, tid: int) -> dict:
        return {**({"id": tid} if ids else {}), "token": token, "logprob": lp, "bytes": list(token.encode())}
    return [{**entry(c["piece"], c["logprob"], c.get("token")),
             "top_logprobs": [entry(t, lp, i) for i, lp, t in c["top_logprobs"]]} for c in chunks if "logprob" in c]


def real_path(path: str) -> str:
    """A path compared as the placer compares it: absolute, links not followed (two library
    names linked to one file are two models, as their owner named them)."""
    return os.path.abspath(path)


def served_file(w: dict) -> str | None:
    """The file a model worker serves: from its stats once loaded, its spec's model before."""
    if w["kind"] not in ("inference", "moe-stream"):
        return None
    path = (w["stats"] or {}).get("path")
    if path:
        return real_path(path)
    from kiln.native.models.library import ModelNotFound, resolve_model
    try:
        return real_path(str(resolve_model(str(w["model"]))))
    except (ModelNotFound, OSError, ValueError):
        return None
