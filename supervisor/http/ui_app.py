"""The dashboard at /ui: static files shipped in the package (supervisor/ui/), no build step and
no CDN, over the same API every client uses; plus the two routes the page needs that the API
lacked — the loaded models (`GET /v1/ps`), loading/unloading one (`POST /v1/models/M/load`) and
its plan against the budget (`GET /v1/models/M/plan`)."""

from __future__ import annotations

from pathlib import Path

import falcon

from .common import JSONError, action_body, bus
from .request_paths import check_model_ref

UI = Path(__file__).with_name("ui")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}


class Static:
    def on_get(self, req, resp):
        self._send(resp, "index.html")

    def on_get_file(self, req, resp, name):
        self._send(resp, name)

    @staticmethod
    def _send(resp, name: str) -> None:
        path = (UI / name).resolve()
        if path.parent != UI.resolve() or not path.is_file() or path.suffix not in _TYPES:
            raise JSONError(404, "not_found", f"no file /ui/{name}")
        resp.data = path.read_bytes()
        resp.content_type = _TYPES[path.suffix]
        resp.set_header("Cache-Control", "no-cache")


class ChatPage:
    def on_get(self, req, resp):
        Static._send(resp, "chat.html")


class Root:
    def on_get(self, req, resp):
        raise falcon.HTTPFound("/ui")


class Models:
    def __init__(self, sup):
        self.sup = sup

    def on_get_ps(self, req, resp):
        resp.media = bus(self.sup, "ps")

    def on_get_action(self, req, resp, model, action):
        if action != "plan":
            raise JSONError(404, "not_found", f"no GET /v1/models/MODEL/{action} (GET …/plan; POST …/load, …/unload)")
        check_model_ref(self.sup, model)
        resp.media = bus(self.sup, "plan", {"model": model})

    def on_post_action(self, req, resp, model, action):
        if action not in ("load", "unload"):
            raise JSONError(404, "not_found", f"no action {action!r} (POST /v1/models/MODEL/load or /unload)")
        # unload {"force": true}: even while it serves requests (they are cut)
        body = action_body(req, ("force",) if action == "unload" else ())
        if not isinstance(body.get("force", False), bool):
            raise JSONError(400, "invalid_type", "force must be a boolean", param="force")
        check_model_ref(self.sup, model)
        resp.media = bus(self.sup, action, {"model": model, **body})


def install(app: falcon.App, sup) -> None:
    app.add_route("/", Root())
    static = Static()
    app.add_route("/ui", static)
    app.add_route("/ui/{name}", static, suffix="file")
    m = Models(sup)
    app.add_route("/v1/ps", m, suffix="ps")
    app.add_route("/v1/models/{model}/{action}", m, suffix="action")
    from . import sessions_routes
    sessions_routes.install(app, sup)
    app.add_route("/ui/chat", ChatPage())
