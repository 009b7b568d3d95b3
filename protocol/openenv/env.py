"""An OpenEnv environment server, as Kiln talks to it (openenv-core's HTTP + WebSocket protocol).

Discovery is three GET documents — /health, /metadata, /schema (the action, observation and
state JSON schemas) — each kept with the sha256 of its canonical JSON, so a rollout can say which
environment it met. An episode is one WebSocket session on /ws: {"type": "reset", "data": {"seed"}}
then {"type": "step", "data": action}, each answered {"type": "observation", "data":
{"observation", "reward", "done"}} or {"type": "error", "data": {"message", "code"}}.

The server is untrusted: every document and message is bounded in size and checked for shape,
a reward must be a finite number, and a socket that closes or stalls mid-episode is an
`EnvError` that says where it happened.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import urllib.error
import urllib.request
from urllib.parse import urlsplit, urlunsplit

MAX_DOCUMENT = 1 << 20          # a discovery document (schemas included)
MAX_MESSAGE = 4 << 20           # one observation
MAX_SCHEMA = 64 << 10           # the action schema the model's output is constrained by
TOKEN_ENV = "KILN_OPENENV_TOKEN"  # a bearer credential for the server, never written to an artifact


class EnvError(RuntimeError):
    """The environment server failed or answered something Kiln will not use."""


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_of(obj) -> str:
    return hashlib.sha256(canonical(obj)).hexdigest()


def _headers() -> dict:
    token = os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


class Environment:
    def __init__(self, url: str, timeout: float = 30.0):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EnvError(f"{url!r} is not an http(s) URL of an OpenEnv server (e.g. http://127.0.0.1:8000)")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.ws_url = urlunsplit(("wss" if parts.scheme == "https" else "ws", parts.netloc,
                                  parts.path.rstrip("/") + "/ws", "", ""))

    def get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers=_headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read(MAX_DOCUMENT + 1)
        except urllib.error.HTTPError as e:
            raise EnvError(f"{self.url}{path} answered HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise EnvError(f"{self.url}{path}: cannot reach the environment server "
                           f"({getattr(e, 'reason', e)}); is it running?") from None
        if len(raw) > MAX_DOCUMENT:
            raise EnvError(f"{self.url}{path}: the document is over {MAX_DOCUMENT} bytes")
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise EnvError(f"{self.url}{path}: not JSON") from None
        if not isinstance(doc, dict):
            raise EnvError(f"{self.url}{path}: expected a JSON object")
        return doc

    def discover(self) -> dict:
        """{"documents": {health, metadata, schema}, "sha256": {each}}; the schema is checked."""
        docs = {name: self.get("/" + name) for name in ("health", "metadata", "schema")}
        schema = docs["schema"]
        for part in ("action", "observation"):
            if not isinstance(schema.get(part), dict) or schema[part].get("type") != "object":
                raise EnvError(f"{self.url}/schema: field {part!r} must be an object's JSON schema")
        if len(canonical(schema["action"])) > MAX_SCHEMA:
            raise EnvError(f"{self.url}/schema: the action schema is over {MAX_SCHEMA} bytes")
        return {"url": self.url, "documents": docs, "sha256": {k: sha256_of(v) for k, v in docs.items()}}

    def session(self) -> "Session":
        return Session(self)


class Session:
    """One episode's WebSocket; use as a context manager."""

    def __init__(self, env: Environment):
        self.env, self.ws = env, None

    def __enter__(self):
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect
        try:
            self.ws = connect(self.env.ws_url, max_size=MAX_MESSAGE, open_timeout=self.env.timeout,
                              additional_headers=_headers())
        except (OSError, WebSocketException, TimeoutError) as e:
            raise EnvError(f"{self.env.ws_url}: cannot open the episode's WebSocket ({e})") from None
        return self

    def __exit__(self, *_):
        # ask the server to end the session and let it close the socket: closing first makes
        # openenv-core's server fail its own close (a traceback in its log per episode)
        try:
            self.ws.send(json.dumps({"type": "close"}))
            self.ws.recv(timeout=2)
        except Exception:  # noqa: BLE001 - the server closed it (expected) or it is already gone
            pass
        self.ws.close()

    def _call(self, message: dict, what: str) -> dict:
        from websockets.exceptions import ConnectionClosed, PayloadTooBig, WebSocketException
        try:
            self.ws.send(json.dumps(message))
            raw = self.ws.recv(timeout=self.env.timeout)
        except PayloadTooBig:
            raise EnvError(f"{what}: the server sent a message over {MAX_MESSAGE} bytes") from None
        except ConnectionClosed as e:
            if any(f is not None and f.code == 1009 for f in (e.sent, e.rcvd)):    # 1009: message too big
                raise EnvError(f"{what}: the server sent a message over {MAX_MESSAGE} bytes") from None
            raise EnvError(f"{what}: the environment closed the connection mid-episode") from None
        except TimeoutError:
            raise EnvError(f"{what}: no answer in {self.env.timeout:g} s") from None
        except (OSError, WebSocketException) as e:
            raise EnvError(f"{what}: {e}") from None
        try:
            reply = json.loads(raw)
        except (ValueError, TypeError):
            raise EnvError(f"{what}: the server answered something that is not JSON") from None
        if not isinstance(reply, dict) or not isinstance(reply.get("data"), dict):
            raise EnvError(f"{what}: expected {{\"type\", \"data\": {{…}}}}")
        if reply.get("type") == "error":
            raise EnvError(f"{what}: the environment refused: {str(reply['data'].get('message'))[:300]}")
        data = reply["data"]
        if reply.get("type") != "observation" or not isinstance(data.get("observation"), dict):
            raise EnvError(f"{what}: expected an observation, got type {str(reply.get('type'))[:40]!r}")
        r = data.get("reward")
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)):
            raise EnvError(f"{what}: reward {json.dumps(r)[:40]} is not a finite number")
        if not isinstance(data.get("done", False), bool):
            raise EnvError(f"{what}: done must be true or false")
        return {"observation": data["observation"], "reward": None if r is None else float(r),
                "done": bool(data.get("done", False))}

    def reset(self, seed: int) -> dict:
        return self._call({"type": "reset", "data": {"seed": int(seed)}}, f"reset (seed {seed})")

    def step(self, action: dict, n: int) -> dict:
        return self._call({"type": "step", "data": action}, f"step {n}")
