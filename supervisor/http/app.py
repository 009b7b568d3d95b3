"""The HTTP front end: a Falcon app on waitress, translating routes into bus commands.

Every error is JSON: {"error": {"code", "type", "message"}} — 404 and 405 included. With
`server.api_key` set, every route but /health needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import hmac
import json
import threading
import time

import falcon
import waitress

from . import (anthropic as anthropic_api, completions_batch, eval_routes as eval_api,
               llama_embeddings, llama_server as llama_server_api, llama_slots, observe, ollama as ollama_api,
               openai as openai_api, openai_responses, openenv_routes as openenv_api, rerank,
               train_routes as train_api, ui_app)
from .common import JSONError, action_body, bus, error_body
from .admission import Admission
from ..core.addresses import check_bind
from .guard import OriginGuard
from .pipeline import Pipeline

def _serialize_error(req, resp, exc: falcon.HTTPError) -> None:
    body = getattr(exc, "kiln_body", None)
    if body is None:
        status = exc.status_code
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(status, "http_error")
        message = exc.description or exc.title or "error"
        if status == 404:
            message = f"no route {req.method} {req.path}"
        elif status == 405:
            message = f"{req.method} is not allowed on {req.path}"
        body = error_body(status, code, message)
    if req.path.startswith("/api/"):             # Ollama's routes answer in Ollama's shape
        body = {"error": body["error"]["message"]}
    elif req.path.startswith("/v1/messages"):    # Anthropic's, in Anthropic's
        body = anthropic_api.error_shape(exc.status_code, body["error"]["message"])
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(body)


def _unexpected(req, resp, ex, params):
    raise JSONError(500, "internal_error", f"{type(ex).__name__}: {ex}")


class Auth:
    def __init__(self, key: str):
        self.key = key

    def process_request(self, req, resp):
        # the page's static files carry no data: the page itself asks for the key
        if not self.key or req.path in ("/health", "/", "/ui") or req.path.startswith("/ui/") \
                or req.method == "OPTIONS":           # a CORS preflight carries no credentials
            return
        got = req.get_header("Authorization") or ""
        key = got[7:].strip() if got.startswith("Bearer ") else req.get_header("x-api-key")   # Anthropic's clients
        if not (key and hmac.compare_digest(key.encode(), self.key.encode())):
            raise JSONError(401, "invalid_api_key", "missing or wrong API key: send 'Authorization: Bearer <key>' "
                            "(or 'x-api-key: <key>')", headers={"WWW-Authenticate": "Bearer"})


class Health:
    def __init__(self, sup):
        self.sup = sup

    def on_get(self, req, resp):
        h = bus(self.sup, "health")
        resp.media = h
        if h["status"] == "unavailable":
            resp.status = falcon.HTTP_503
            resp.set_header("Retry-After", "1")


class Config:
    """GET /v1/config: every effective setting and its source (default, file, env, cli), as `kiln
    config --json` prints them — the key itself never leaves the daemon."""

    SECRETS = {("server", "api_key")}

    def __init__(self, sup):
        self.sup = sup

    def on_get(self, req, resp):
        out = bus(self.sup, "config")
        for sec, key in self.SECRETS:
            field = out.get(sec, {}).get(key)
            if field and field.get("value"):
                field["value"] = "(set)"
        resp.media = out


class Workers:
    def __init__(self, sup):
        self.sup = sup

    def on_get(self, req, resp):
        resp.media = {"object": "list", "data": bus(self.sup, "status")["workers"]}

    def on_get_one(self, req, resp, name):
        resp.media = bus(self.sup, "worker", {"name": name})

    def on_post_action(self, req, resp, name, action):
        if action not in ("restart", "stop", "start"):
            raise JSONError(404, "not_found", f"no action {action!r} (actions: restart, stop, start)")
        action_body(req)
        bus(self.sup, action, {"name": name})
        resp.media = bus(self.sup, "worker", {"name": name}) if name != "all" else {"ok": True}


class Events:
    """GET /v1/events: the daemon's event stream as server-sent events (`?after=SEQ` to resume);
    a comment line every 15 s keeps idle connections open."""

    def __init__(self, sup):
        self.sup = sup

    def on_get(self, req, resp):
        after = req.get_param_as_int("after") or 0
        disconnected = req.env.get("waitress.client_disconnected") or (lambda: False)
        log = self.sup.events

        def stream():
            nonlocal after
            quiet_since = time.monotonic()
            while not disconnected():          # checked each second: a gone client frees its thread
                got = log.wait(after, 1.0)
                if not got:
                    if time.monotonic() - quiet_since >= 15:
                        yield b": keep-alive\n\n"
                        quiet_since = time.monotonic()
                    continue
                for e in got:
                    yield f"id: {e['seq']}\nevent: {e['event']}\ndata: {json.dumps(e)}\n\n".encode()
                    after = e["seq"]
                quiet_since = time.monotonic()
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-cache")
        resp.stream = stream()


def make_app(sup) -> falcon.App:
    metrics = observe.Metrics(sup)
    middleware = [observe.RequestLog(metrics), OriginGuard(sup.cfg["server"])]
    origins = [o.strip() for o in sup.cfg["server"]["cors_origins"].split(",") if o.strip()]
    if origins:      # off by default: a page elsewhere may not read this API unless named here
        middleware.append(falcon.CORSMiddleware(allow_origins="*" if origins == ["*"] else origins,
                                                expose_headers=["Retry-After"]))
    srv = sup.cfg["server"]
    app = falcon.App(middleware=middleware + [Auth(srv["api_key"]),
                                              Admission(srv["threads"], srv["max_event_streams"])])
    app.req_options.strip_url_path_trailing_slash = True
    app.set_error_serializer(_serialize_error)
    app.add_error_handler(Exception, _unexpected)
    app.add_route("/health", Health(sup))
    app.add_route("/v1/events", Events(sup))
    app.add_route("/v1/config", Config(sup))
    workers = Workers(sup)
    app.add_route("/v1/workers", workers)
    app.add_route("/v1/workers/{name}", workers, suffix="one")
    app.add_route("/v1/workers/{name}/{action}", workers, suffix="action")
    app.add_route("/metrics", observe.MetricsRoute(metrics))
    pipe = Pipeline(sup, metrics)
    for dialect in (openai_api, ollama_api, openai_responses, anthropic_api, llama_server_api):
        dialect.install(app, sup, pipe)
    llama_slots.install(app, pipe)
    completions_batch.install(app, pipe)
    rerank.install(app, pipe)
    llama_embeddings.install(app, pipe)
    ui_app.install(app, sup)
    train_api.install(app, sup, pipe.read_json)
    eval_api.install(app, sup, pipe.read_json)
    openenv_api.install(app, sup, pipe.read_json)
    return app


def serve_http(sup):
    """Start waitress in a thread; return (server, (host, port))."""
    s = sup.cfg["server"]
    unsafe = check_bind(s)
    if unsafe:
        raise ValueError(unsafe)
    server = waitress.create_server(make_app(sup), host=s["host"], port=s["port"], threads=s["threads"],
                                    send_bytes=1, channel_request_lookahead=5, ident="kiln",
                                    # above our own limit, so that the app answers a JSON 413
                                    # instead of waitress dropping the connection
                                    max_request_body_size=max(64 * 2**20, 4 * s["max_body_bytes"]),
                                    clear_untrusted_proxy_headers=True)
    t = threading.Thread(target=server.run, name="kiln-http", daemon=True)
    t.start()
    return server, (s["host"], server.effective_port)
