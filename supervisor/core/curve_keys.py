"""ZeroMQ CURVE on the worker socket when workers run on other machines: the supervisor's keypair
for one `kiln up`, the client keys it issues (one per spawned worker process, handed to the
process through its spawner — never written to disk), and the ZAP handler that admits only those.

CURVE encrypts and authenticates every frame (its per-message nonces also refuse a replayed or
reordered frame at the transport); the HMAC of the wire format stays on top. The ZAP handler
names each admitted connection after the worker the key was issued to (ZeroMQ's `User-Id` frame
property), so the supervisor can check that a message claiming to be worker W arrived on the
connection W's key opened — a worker cannot speak for another with its own valid key.
"""

from __future__ import annotations

import threading

import zmq
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "kiln"


class _Authenticator(ThreadAuthenticator):
    def __init__(self, ctx: zmq.Context, keys: "WorkerKeys"):
        super().__init__(ctx)
        self.keys = keys

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.keys.owner(zmq.utils.z85.encode(client_public_key)) or ""


class WorkerKeys:
    def __init__(self, ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.public, self.secret = zmq.curve_keypair()
        self._issued: dict[bytes, str] = {}          # client public key (z85) -> worker name
        self._lock = threading.Lock()
        self.refused = 0                             # handshakes with a key we did not issue
        self._auth: _Authenticator | None = None

    def start(self) -> None:
        self._auth = _Authenticator(self.ctx, self)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def serve_on(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server checked by this handler (before it binds)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    def issue(self, worker: str) -> tuple[bytes, bytes]:
        """A fresh (public, secret) client keypair for one process of `worker`."""
        public, secret = zmq.curve_keypair()
        with self._lock:
            self._issued[public] = worker
        return public, secret

    def revoke(self, public: bytes) -> None:
        """The process the key was issued to is gone: its key opens nothing any more."""
        with self._lock:
            self._issued.pop(public, None)

    def owner(self, public: bytes) -> str | None:
        with self._lock:
            return self._issued.get(public)

    # the ZAP handler's question (its thread): is this a key we issued?
    def callback(self, domain: str, key: bytes) -> bool:
        ok = self.owner(key) is not None
        if not ok:
            with self._lock:
                self.refused += 1
        return ok
