"""CURVE on the cluster's worker socket (issue 41), on real ZeroMQ sockets: only a key the
supervisor issued opens a connection, the connection is named after the worker the key was
issued to, a revoked key opens nothing new, and a message naming another worker is refused."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import zmq

from kiln.supervisor.core.curve_keys import WorkerKeys
from kiln.supervisor.core.sockets import SocketTraffic


@pytest.fixture
def server():
    ctx = zmq.Context()
    keys = WorkerKeys(ctx)
    keys.start()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    keys.serve_on(sock)
    sock.bind("tcp://127.0.0.1:*")
    yield ctx, keys, sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(0)
    keys.stop()
    ctx.destroy(linger=0)


def _client(ctx, endpoint: str, server_key: bytes, keypair, identity: str = "w1:1"):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt_string(zmq.IDENTITY, identity)
    if keypair is not None:
        s.curve_publickey, s.curve_secretkey = keypair
        s.curve_serverkey = server_key
    s.connect(endpoint)
    return s


def _until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_an_issued_key_connects_and_its_connection_is_named_after_its_worker(server):
    ctx, keys, sock, ep = server
    c = _client(ctx, ep, keys.public, keys.issue("w1"))
    c.send(b"hello")
    assert sock.poll(5000)
    frames = sock.recv_multipart(copy=False)
    assert frames[0].bytes == b"w1:1" and frames[-1].bytes == b"hello"
    assert frames[-1].get("User-Id") == "w1"


@pytest.mark.parametrize("how", ["own key", "no curve", "revoked"])
def test_a_key_not_issued_or_revoked_opens_nothing(server, how):
    ctx, keys, sock, ep = server
    if how == "revoked":
        pair = keys.issue("w1")
        keys.revoke(pair[0])
    else:
        pair = zmq.curve_keypair() if how == "own key" else None
    c = _client(ctx, ep, keys.public, pair)
    c.send(b"hello")
    if how != "no curve":             # a plain peer fails the mechanism itself, before any key is asked
        assert _until(lambda: keys.refused >= 1)
    assert not sock.poll(500)


class _Traffic(SocketTraffic):
    def __init__(self):
        self.bad_frames = Counter()
        self.decoded = 0

    def _decode(self, sock, frames):
        self.decoded += 1
        return frames[0], None


def test_a_message_naming_another_worker_than_its_key_is_refused_and_counted():
    t = _Traffic()
    t.worker_sock = None
    t._on_worker_frames([b"big:42", b"KILN/1"], key_owner="small")
    assert t.bad_frames["foreign_key"] == 1 and t.decoded == 0
    t._on_worker_frames([b"small:42", b"KILN/1"], key_owner="small")
    t._on_worker_frames([b"small:42", b"KILN/1"], key_owner=None)      # ipc: no CURVE, no owner
    assert t.bad_frames["foreign_key"] == 1 and t.decoded == 2


class _NodeProc:
    """A cluster handle as the process table sees it: no pid until the hello, a spawn token."""
    local, node = False, None

    def __init__(self):
        self.pid, self.token, self.returncode = None, "t0k3n", None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        pass


def test_a_hello_without_its_spawns_token_is_refused_as_a_stale_or_foreign_worker():
    from fakes import FakeClock
    from kiln.supervisor.core import policy
    from kiln.supervisor.core.process_table import ProcessTable

    class Spawner:
        def spawn(self, name, spec):
            return _NodeProc()
    table = ProcessTable({"w": {"kind": "inference"}}, policy.Settings(1, 3, 60, 0.5, 8, 10, 10), Spawner(), FakeClock())
    table.apply(table["w"], policy.Start(manual=False))
    hello = {"kind": "inference", "ops": []}
    assert table.on_hello(b"w:77", "w", 77, {**hello, "token": "stale"}, {}) is None
    assert table.on_hello(b"w:77", "w", 77, hello, {}) is None                 # none at all
    assert table.on_hello(b"w:78", "w", 77, {**hello, "token": "t0k3n"}, {}) is None   # identity not its pid
    w = table.on_hello(b"w:77", "w", 77, {**hello, "token": "t0k3n"}, {})
    assert w is not None and w.pid == 77 and table.by_peer(b"w:77") is w
