"""What every HTTP route module shares: the JSON error shape, and the two ways a route reaches
the supervisor — a bus command (`bus`) or a routed op (`routed`, `error_from`)."""

from __future__ import annotations

import json
import queue

import falcon

from kiln.protocol.vocab import http_status

from .commands import CommandError

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


def action_body(req, allowed: tuple[str, ...] = ()) -> dict:
    """The body of an action route (restart, load, unload, cancel): none, `{}`, or only the
    `allowed` fields — anything else is a 400 naming it, not a field quietly ignored."""
    raw = req.bounded_stream.read(1 << 16)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise JSONError(400, "invalid_json", f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise JSONError(400, "invalid_json", "the body must be a JSON object")
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
    call = sup.request(op, body, timeout)
    try:
        msg = call.events.get(timeout=timeout + 5)
    except queue.Empty:
        call.cancel()
        raise JSONError(504, "timeout", f"{op} was not answered within {timeout:g} s") from None
    if msg.type == "error":
        raise error_from(msg, param)
    return msg.body
