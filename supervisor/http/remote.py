"""Fetching what a request names by URL (an image, with server.fetch_images on) without letting
the request reach what its sender cannot: the host is resolved once, every address it gives must
be a public one (not loopback, private, link-local, shared, reserved or multicast), and the
connection goes to the address that was checked — a DNS answer that changes between the check
and the connect (rebinding) cannot move it. No redirects are followed; the body is bounded."""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from urllib.parse import urlsplit

TIMEOUT_S = 10.0


class FetchError(ValueError):
    """Why a URL was not fetched: the message says so to the client."""


def _public(addr) -> bool:
    return addr.is_global and not addr.is_multicast


def resolve_public(host: str, port: int, allowed=_public) -> str:
    """The address to connect to: the first the host resolves to, all of them checked."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise FetchError(f"cannot resolve {host!r}: {e}") from None
    addrs = [ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos]
    refused = [a for a in addrs if not allowed(a)]
    if not addrs or refused:
        raise FetchError(f"{host} resolves to {refused[0] if refused else 'nothing'}, not a public address: Kiln "
                         f"never fetches from loopback, private or link-local addresses — send the bytes")
    return str(addrs[0])


class _Pinned(http.client.HTTPSConnection):
    """HTTPS to a checked address, the certificate verified for the URL's host name."""

    def __init__(self, host: str, addr: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._addr = addr

    def connect(self):
        sock = socket.create_connection((self._addr, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def fetch_public(url: str, limit: int, allowed=_public, timeout: float = TIMEOUT_S) -> bytes:
    """The body at `url` (http or https, at most `limit` bytes), fetched from a public address."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"only http(s) URLs with a host are fetched, not {url[:80]!r}")
    if parts.username or parts.password:
        raise FetchError("a URL with credentials in it is not fetched")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addr = resolve_public(parts.hostname, port, allowed)
    conn = _Pinned(parts.hostname, addr, port, timeout) if parts.scheme == "https" else \
        http.client.HTTPConnection(addr, port, timeout=timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("GET", path, headers={"Host": parts.netloc.rsplit("@", 1)[-1], "User-Agent": "kiln",
                                           "Accept": "image/*"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise FetchError(f"{url[:120]} answered {resp.status} {resp.reason}"
                             + (" (redirects are not followed)" if 300 <= resp.status < 400 else ""))
        size = resp.getheader("Content-Length")
        if size and size.isdigit() and int(size) > limit:
            raise FetchError(f"{url[:120]} is {int(size)} bytes, over the {limit >> 20} MiB limit")
        body = resp.read(limit + 1)
        if len(body) > limit:
            raise FetchError(f"{url[:120]} is over the {limit >> 20} MiB limit")
        return body
    except (OSError, http.client.HTTPException) as e:
        raise FetchError(f"cannot fetch {url[:120]}: {e}") from None
    finally:
        conn.close()
