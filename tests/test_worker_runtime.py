"""A worker process against a raw socket standing in for the supervisor: what the runtime does
when the thread that started it ends while the process that owns it lives on.

The kernel sends the parent-death signal when the *thread* that forked a process exits — and,
while a process exits thread by thread (a Ray actor dying with its node), before getppid()
changes. A worker that read that signal as a graceful stop told a client whose stream its node's
loss had cut "worker … is shutting down" (a stop no one asked for) instead of "lost"."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from kiln.protocol import decode_frames, encode_frames, make

pytestmark = pytest.mark.timeout(60)
TESTS = Path(__file__).parent


def _receive(sock, key, timeout=10.0):
    assert sock.poll(int(timeout * 1000)), "the worker sent nothing"
    ident, *frames = sock.recv_multipart()
    return ident, decode_frames(frames, key)


def _next(sock, key, types, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ident, msg = _receive(sock, key, deadline - time.monotonic())
        if msg.type in types:
            return ident, msg
    raise AssertionError(f"no {types} from the worker within {timeout} s")


def test_a_worker_whose_starting_thread_ends_keeps_serving(tmp_path):
    key = os.urandom(32)
    key_file = tmp_path / "key"
    key_file.write_bytes(key)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/w.sock"
    sock.bind(endpoint)
    env = {**os.environ, "KILN_WORKER_NAME": "t", "KILN_ENDPOINT": endpoint, "KILN_WORKER_KEY_FILE": str(key_file),
           "KILN_HEARTBEAT_INTERVAL": "0.2",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    started, hello_seen, procs = threading.Event(), threading.Event(), []

    def starter():                         # the forking thread: it ends once the worker said hello
        with open(tmp_path / "worker.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "kiln_test_worker"], env=env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        started.set()
        hello_seen.wait(30)

    t = threading.Thread(target=starter)
    t.start()
    try:
        assert started.wait(30)
        ident, hello = _next(sock, key, {"hello"}, 30)
        assert hello.get("pid") == procs[0].pid
        hello_seen.set()
        t.join()                           # the kernel signals the worker now; we, its parent, live on
        _next(sock, key, {"heartbeat"})    # a beat after the signal: it has acted on it by then
        _next(sock, key, {"heartbeat"})
        req = make("request", op="stream", body={"n": 3})
        sock.send_multipart([ident, *encode_frames(req, key)])
        chunks = 0
        while True:
            _, msg = _next(sock, key, {"chunk", "reply", "error"})
            if msg.type == "chunk":
                chunks += 1
                continue
            assert msg.type == "reply", f"the worker answered {msg.type}: {msg.header}"
            break
        assert chunks == 3 and procs[0].poll() is None
    finally:
        hello_seen.set()
        for p in procs:
            p.kill()
            p.wait()
        sock.close(0)
        ctx.destroy(linger=0)
        print((tmp_path / "worker.log").read_text(errors="replace"))
