"""Who may talk to the daemon over HTTP: the loopback API is reachable by every web page the user
opens, so a request must show it comes from this machine's own clients, not from a page elsewhere.

- `Host` must name this server: a loopback name (localhost, 127.x, [::1]) or one of
  `server.allowed_hosts` — a page on evil.example that rebinds its name to 127.0.0.1 sends
  `Host: evil.example` and is refused (DNS rebinding).
- `Origin`, when a browser sends one, must be this server's own origin or one of
  `server.cors_origins` — a foreign page's POST is refused before it runs (CSRF).
- A body must say it is JSON: `text/plain` and `multipart/form-data` are what a page elsewhere can
  send without a CORS preflight, so they are 415. `application/x-www-form-urlencoded` is what
  `curl -d` sends (Ollama's own examples): accepted only from a client that sends no Origin.

Jupyter's and Ollama's model; see docs/security.md.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..core.addresses import bind_hosts, host_name, is_loopback, split_list
from .common import JSONError

_BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


class OriginGuard:
    """Falcon middleware: Host, Origin and body type, checked before any route runs."""

    def __init__(self, server: dict):
        allowed = split_list(server["allowed_hosts"])
        self.any_host = "*" in allowed
        self.hosts = {host_name(h) for h in allowed} | bind_hosts(server["host"])
        origins = split_list(server["cors_origins"])
        self.any_origin = "*" in origins
        self.origins = {o.rstrip("/").lower() for o in origins}

    def process_request(self, req, resp):
        host = req.get_header("Host")
        if host is not None and not self.any_host:     # HTTP/1.0 clients may send none; browsers always do
            name = host_name(host)
            if not (is_loopback(name) or name in self.hosts):
                raise JSONError(403, "host_not_allowed",
                                f"Host {host!r} is not this server's name: Kiln answers loopback names and "
                                f"server.allowed_hosts only (a page that rebinds its own name to this machine "
                                f"is refused). Add the name to server.allowed_hosts if you reach Kiln by it")
        origin = req.get_header("Origin")
        if origin is not None and not self._origin_ok(origin, host):
            raise JSONError(403, "origin_not_allowed",
                            f"a page at {origin!r} may not call this API: only Kiln's own page and "
                            f"server.cors_origins may (add the origin there to let that page in)")
        if req.method in _BODY_METHODS and _has_body(req):
            kind = (req.content_type or "").split(";")[0].strip().lower()
            json_ok = kind == "" or kind == "application/json" or kind.endswith("+json")
            curl_form = kind == "application/x-www-form-urlencoded" and origin is None
            if not (json_ok or curl_form):
                raise JSONError(415, "unsupported_media_type",
                                f"{req.method} {req.path} takes a JSON body: send 'Content-Type: "
                                f"application/json' (got {req.content_type!r})")

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        o = origin.strip().rstrip("/").lower()
        if self.any_origin or o in self.origins:
            return True
        parts = urlsplit(o)
        return parts.scheme in ("http", "https") and host is not None and parts.netloc == host.strip().lower()


def _has_body(req) -> bool:
    return bool(req.content_length) or "chunked" in (req.get_header("Transfer-Encoding") or "").lower()
