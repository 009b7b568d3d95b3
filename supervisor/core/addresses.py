"""Which names and addresses are this machine's, and whether a bind is safe without a key: the
rules `kiln up` checks before it serves (check_bind) and the HTTP guard checks on every request."""

from __future__ import annotations

import ipaddress
import socket

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


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
