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

Jupyter's and Ollama's model; see the README's security section.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from .http_common import JSONError

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
_BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def host_name(hostport: str) -> str:
    """`[::1]:8420` → `::1`, `Example.COM:80` → `example.com`."""
    h = hostport.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def is_loopback(name: str) -> bool:
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def bind_hosts(bind: str) -> set[str]:
    """The names a client beyond loopback reaches a server bound to `bind` by: the address itself,
    or, for a wildcard bind, every address of this machine and its host names."""
    name = host_name(bind) if bind.startswith("[") else bind.strip().lower()
    if is_loopback(name):
        return set()
    if name not in ("", "0.0.0.0", "::"):
        return {name}
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    try:
        import psutil
        for addrs in psutil.net_if_addrs().values():
            names.update(a.address.split("%")[0].lower() for a in addrs
                         if a.family in (socket.AF_INET, socket.AF_INET6))
    except Exception:  # noqa: BLE001 - no interface list: the host names and allowed_hosts still serve
        pass
    return names


def check_bind(server: dict) -> str | None:
    """Why serving `server` (the config's section) would be unsafe, or None: an API beyond loopback
    with no key lets anyone who reaches the port run, change and stop Kiln."""
    name = host_name(server["host"]) if server["host"].startswith("[") else server["host"].strip().lower()
    if is_loopback(name) or server["api_key"] or server["insecure_no_key"]:
        return None
    return (f"server.host = {server['host']!r} serves beyond this machine, and server.api_key is empty: anyone "
            f"who reaches port {server['port']} could run, change and stop Kiln. Set server.api_key "
            f"(KILN_SERVER_API_KEY), bind to 127.0.0.1, or pass --insecure-no-key (server.insecure_no_key) "
            f"if a firewall or proxy in front of it already decides who gets in")


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
