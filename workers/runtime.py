"""The runtime every worker kind runs on: connect, hello, heartbeats, op dispatch, exit rules.

A worker kind (workers/worker.py) subclasses `Worker`, implements `boot()` (load what it needs;
raise `BootError` with a one-line reason for a config mistake) and registers ops with
`@op("name")`. A handler
gets a `Request` and returns the reply body, or is a generator: each `yield` sends a `chunk`,
the `return` value is the reply. Cancellation is honoured between chunks; a handler may also
poll `req.cancelled()`.

Threads: the main thread owns the ZeroMQ socket (heartbeats, incoming messages, cancel); one
executor thread runs boot() and then the ops, one at a time, and hands its outgoing messages
to the main thread through an inproc socket. So a long op never delays a heartbeat — as long as
it lets go of the GIL, as the compiled kernels and the tokenization of long texts do. An op that
holds it anyway still shows in the process's CPU time, which the supervisor tells from a hang.

Exit rules: `shutdown` or SIGTERM → finish or cancel the running op, exit 0; parent gone →
exit (its requests end as the supervisor tells a lost worker's: run again, or "lost"); boot
error → send `error` boot_failed, print the reason, exit 3.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Iterator

import zmq

from kiln.protocol import (PROTOCOL_VERSION, Message, ProtocolError, SchemaError, decode_frames,
                           encode_frames, make, validate_body, version_error, vocab)

from .worker import EXIT_BOOT_ERROR, BootError, Chunk, OpError, Request, Worker


# The parent-death signal is not SIGTERM: the kernel sends it when the thread that forked us exits,
# which — while a process exits thread by thread — comes before getppid() changes. A SIGTERM then
# began a graceful stop, and a stream cut by its node's loss read "worker is shutting down" (a
# request the supervisor never asked to stop). SIGHUP only wakes the loop; getppid() decides.
PARENT_DEATH_SIGNAL = signal.SIGHUP


def _set_parent_death_signal() -> None:
    """Linux: have the kernel signal us when the supervisor (our parent thread) dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, PARENT_DEATH_SIGNAL)     # PR_SET_PDEATHSIG
    except OSError:
        pass


class Runtime:
    def __init__(self, worker: Worker, endpoint: str, key: bytes, heartbeat_interval: float = 1.0,
                 secrets: dict | None = None):
        self.worker, self.endpoint, self.key = worker, endpoint, key
        self.interval = heartbeat_interval
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.token = (secrets or {}).get("token")
        if secrets:                                       # a node of a cluster: CURVE over TCP
            self.sock.curve_serverkey = secrets["server_key"].encode()
            self.sock.curve_publickey = secrets["public"].encode()
            self.sock.curve_secretkey = secrets["secret"].encode()
        self.sock.setsockopt_string(zmq.IDENTITY, f"{worker.name}:{os.getpid()}")
        self.inbox = self.ctx.socket(zmq.PULL)          # executor and op threads -> main thread
        self.inbox.bind(f"inproc://kiln-worker-{id(self)}")
        self._busy = 0
        self._busy_lock = threading.Lock()
        self.jobs: queue.Queue = queue.Queue()
        self.requests: dict[str, Request] = {}            # queued or running, by id
        self.stopping = False
        self._signalled = False
        self.exit_code = 0
        self.handlers = worker.ops()
        self.parent = os.getppid()
        self.upward: dict[str, queue.Queue] = {}          # our own requests to the supervisor, by id
        self._local = threading.local()                   # each thread's outbox for post_up
        self._beat_now = False
        worker.runtime = self

    # -- main thread --------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(encode_frames(msg, self.key))

    def run(self) -> int:
        _set_parent_death_signal()
        # the handler only notes the signal: it runs between two bytecodes of this thread, which
        # may be holding a lock that stopping needs; the loop below acts on it within 0.25 s
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(PARENT_DEATH_SIGNAL, lambda *_: None)   # the loop's getppid() check acts on it
        # a blocked SIGTERM (a mask inherited through the supervisor) would defeat the supervisor's
        # graceful stop, a blocked SIGHUP the parent-death signal
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                                    PARENT_DEATH_SIGNAL})
        faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1`: stacks to the log
        self.sock.connect(self.endpoint)
        self.send(make("hello", name=self.worker.name, kind=self.worker.kind, pid=os.getpid(),
                       protocol=PROTOCOL_VERSION, ops=sorted(self.handlers), stop_grace=self.worker.stop_grace,
                       **({"token": self.token} if self.token else {}), body={"state": self.worker.state}))
        executor = threading.Thread(target=self._executor, name="kiln-executor", daemon=True)
        executor.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.inbox, zmq.POLLIN)
        next_beat = time.monotonic()
        stop_deadline = None
        while True:
            now = time.monotonic()
            if now >= next_beat or self._beat_now:
                self._beat_now = False
                self.send(make("heartbeat", body=self._beat_body()))
                next_beat = now + self.interval
            if os.getppid() != self.parent:
                print(f"kiln worker {self.worker.name}: supervisor gone; exiting", file=sys.stderr)
                return 1
            if self._signalled and not self.stopping:
                self._begin_stop()
            if self.stopping:
                stop_deadline = stop_deadline or now + (self.worker.stop_grace or 5.0)
                if (not self.requests and self.jobs.empty() and not self.worker.stop_pending()) \
                        or now > stop_deadline:
                    return self.exit_code
            events = dict(poller.poll(max(0.0, min(next_beat - now, 0.25)) * 1000))
            if self.inbox in events:
                for _ in range(1000):         # bounded: a flood of chunks cannot put off the next beat
                    if not self.inbox.poll(0):
                        break
                    kind, payload = self.inbox.recv_pyobj()
                    if kind == "send":
                        self.send(payload)
                    elif kind == "done":
                        self.requests.pop(payload, None)
                    elif kind == "beat":               # state changed (booted): tell the supervisor now
                        self._beat_now = True
                    elif kind == "up":                 # a request of ours, sent up to the router
                        self.send(payload)
                    elif kind == "boot_failed":
                        self.send(make("error", code="boot_failed", message=payload))
                        print(f"kiln worker {self.worker.name}: boot failed: {payload}", file=sys.stderr)
                        return EXIT_BOOT_ERROR
            if self.sock in events:
                while self.sock.poll(0):
                    self._receive(self.sock.recv_multipart())

    def _beat_body(self) -> dict:
        """The heartbeat's body: the worker's state and stats. A failing stats call costs the
        stats, never the heartbeat (the supervisor would kill a healthy worker)."""
        try:
            return {"state": self.worker.state, **self.worker.status()}
        except Exception as e:  # noqa: BLE001
            return {"state": self.worker.state, "status_error": f"{type(e).__name__}: {e}"[:300]}

    def _receive(self, frames: list[bytes]) -> None:
        try:
            msg = decode_frames(frames, self.key)
        except ProtocolError as e:
            if e.kind == "version":
                self.sock.send_multipart(version_error(e.peer_version, self.key))
            print(f"kiln worker {self.worker.name}: dropped a message: {e}", file=sys.stderr)
            return
        if msg.type in ("chunk", "reply", "error") and msg.id in self.upward:
            self.upward[msg.id].put(msg)
        elif msg.type == "request":
            self._accept(msg)
        elif msg.type == "cancel":
            req = self.requests.get(msg.id)
            if req:
                req._cancel.set()
        elif msg.type == "shutdown":
            self._begin_stop()

    def _accept(self, msg: Message) -> None:
        opname = msg.header["op"]
        if self.stopping:
            self.send(make("error", id=msg.id, code="shutting_down", retryable=True,
                           message=f"worker {self.worker.name} is shutting down"))
            return
        if opname not in self.handlers:
            self.send(make("error", id=msg.id, code="unknown_op",
                           message=f"worker kind {self.worker.kind!r} has no op {opname!r} "
                                   f"(ops: {', '.join(sorted(self.handlers))})"))
            return
        try:
            body = validate_body(opname, msg.body)
        except SchemaError as e:
            self.send(make("error", id=msg.id, code="bad_request", message=str(e)))
            return
        req = Request(msg.id, opname, body, msg.buffers, msg.get("deadline"))
        if opname in ("ping", "stats"):                  # answered at once, even when busy
            self.send(make("reply", id=req.id, body=self.handlers[opname](req)))
            return
        self.requests[req.id] = req
        if getattr(self.handlers[opname], "_kiln_concurrent", False):
            threading.Thread(target=self._run_concurrent, args=(req,), name=f"kiln-op-{opname}", daemon=True).start()
        else:
            self.jobs.put(req)

    def _on_signal(self, _signum, _frame) -> None:
        self._signalled = True

    def _begin_stop(self) -> None:
        self.stopping = True
        for req in self.requests.values():
            req.stopping = True
            req._cancel.set()
        self.worker.on_stop()

    # -- executor thread ----------------------------------------------------------------------

    def _outbox(self) -> zmq.Socket:
        out = self.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 1000)
        out.connect(f"inproc://kiln-worker-{id(self)}")
        return out

    def _busy_delta(self, n: int) -> None:
        with self._busy_lock:
            self._busy += n
            if self.worker.state in (vocab.READY, vocab.BUSY):
                self.worker.state = vocab.BUSY if self._busy else vocab.READY

    def _run_concurrent(self, req: Request) -> None:
        while self.worker.state in vocab.WORKER_LOADING and not req.cancelled():
            time.sleep(0.05)                      # a request that arrives while booting waits
        out = self._outbox()
        self._busy_delta(1)
        try:
            for msg in self._execute(req):
                out.send_pyobj(("send", msg))
        finally:
            self._busy_delta(-1)
            out.send_pyobj(("done", req.id))
            out.close()

    def _executor(self) -> None:
        out = self._outbox()
        post = out.send_pyobj
        try:
            self.worker.boot()
            self.worker.state = vocab.BUSY if self._busy else vocab.READY
            post(("beat", None))
        except BootError as e:
            post(("boot_failed", str(e)))
            return
        except Exception as e:  # noqa: BLE001 - an unexpected boot crash is a boot error too
            traceback.print_exc()
            post(("boot_failed", f"{type(e).__name__}: {e}"))
            return
        while True:
            req = self.jobs.get()
            if req.cancelled():
                post(("send", self._cancelled(req)))
            else:
                self._busy_delta(1)
                for msg in self._execute(req):
                    post(("send", msg))
                self._busy_delta(-1)
            post(("done", req.id))

    def _cancelled(self, req: Request) -> Message:
        if req.stopping:        # not the client's wish: the router sends it again to our successor
            return make("error", id=req.id, code="shutting_down", retryable=True,
                        message=f"worker {self.worker.name} is shutting down")
        return make("error", id=req.id, code="cancelled", message="cancelled")

    # -- requests of our own, sent up (any thread) ------------------------------------------------

    def post_up(self, msg: Message) -> None:
        """Hand `msg` to the main thread to send up, on this thread's own outbox (kept: a socket
        made per call cost a tenth of a millisecond on every step of a split model)."""
        out = getattr(self._local, "out", None)
        if out is None:
            out = self._local.out = self._outbox()
        out.send_pyobj(("up", msg))

    def send_up(self, op: str, body: dict | None = None, timeout: float = 600.0, buffers: list | None = None):
        """A request up whose reply is collected later (`.result()`, workers/upcall.py)."""
        from .upcall import UpCall
        return UpCall(self, op, body or {}, timeout, buffers)

    def request_up(self, op: str, body: dict | None = None, timeout: float = 600.0,
                   buffers: list | None = None) -> Iterator[Message]:
        """Ask the supervisor's router for a service (e.g. the evaluator's `generate`): yields each
        chunk, then the reply; an error raises OpError with the router's code. The router checks
        the op against this worker kind's allow-list."""
        from .upcall import UpCall
        yield from UpCall(self, op, body or {}, timeout, buffers).messages()

    def _execute(self, req: Request) -> Iterator[Message]:
        try:
            result = self.handlers[req.op](req)
            if isinstance(result, Iterator):
                seq = 0
                while True:
                    if req.cancelled():
                        result.close()
                        yield self._cancelled(req)
                        return
                    try:
                        item = next(result)
                    except StopIteration as stop:
                        result = stop.value
                        break
                    chunk = item if isinstance(item, Chunk) else Chunk(item)
                    yield make("chunk", id=req.id, seq=seq, body=chunk.body, buffers=chunk.buffers)
                    seq += 1
            if req._cancel.is_set():
                yield self._cancelled(req)
                return
            if req.deadline is not None and time.time() > req.deadline:
                yield make("error", id=req.id, code="deadline_exceeded",
                           message="the request took longer than its deadline")
                return
            if isinstance(result, Chunk):
                yield make("reply", id=req.id, body=result.body, buffers=result.buffers)
            else:
                yield make("reply", id=req.id, body=result)
        except OpError as e:
            yield make("error", id=req.id, code=e.code, message=e.message, retryable=e.retryable)
        except Exception as e:  # noqa: BLE001 - an op's failure must not kill the worker
            traceback.print_exc()
            yield make("error", id=req.id, code="op_failed", message=f"{type(e).__name__}: {e}")




def _read_secrets() -> dict:
    """A worker on a cluster node gets its secrets on stdin, one JSON line, never in a file or
    its environment: the wire's HMAC key, the supervisor's CURVE public key, its own CURVE
    keypair and the token its hello must carry (ray_spawner.py writes them)."""
    line = sys.stdin.buffer.readline(64 * 1024)
    sys.stdin.close()
    got = json.loads(line)
    if not isinstance(got, dict) or not all(isinstance(got.get(k), str) for k in
                                            ("hmac", "server_key", "public", "secret", "token")):
        raise ValueError("the secrets on stdin are not the spawner's JSON line")
    return got


def main(worker_cls: type[Worker]) -> None:
    """Entry point of a worker process; its configuration comes from the environment the
    supervisor sets: KILN_WORKER_NAME, KILN_ENDPOINT, KILN_WORKER_KEY_FILE, KILN_WORKER_SETTINGS
    (JSON), KILN_HEARTBEAT_INTERVAL."""
    name = os.environ.get("KILN_WORKER_NAME", worker_cls.kind)
    try:
        from setproctitle import setproctitle
        setproctitle(f"kiln: {worker_cls.kind} worker {name}")
    except ImportError:
        pass
    try:
        endpoint = os.environ["KILN_ENDPOINT"]
        secrets = _read_secrets() if os.environ.get("KILN_SECRETS") == "stdin" else {}
        key = bytes.fromhex(secrets["hmac"]) if secrets else open(os.environ["KILN_WORKER_KEY_FILE"], "rb").read()
        settings = json.loads(os.environ.get("KILN_WORKER_SETTINGS") or "{}")
        interval = float(os.environ.get("KILN_HEARTBEAT_INTERVAL", "1.0"))
    except (KeyError, OSError, ValueError) as e:
        print(f"kiln worker {name}: cannot start: {type(e).__name__}: {e} "
              f"(workers are started by `kiln up`)", file=sys.stderr)
        sys.exit(EXIT_BOOT_ERROR)
    try:
        worker = worker_cls(name, settings)
    except BootError as e:
        print(f"kiln worker {name}: boot failed: {e}", file=sys.stderr)
        sys.exit(EXIT_BOOT_ERROR)
    runtime = Runtime(worker, endpoint, key, interval, secrets)
    code = runtime.run()
    runtime.sock.close(linger=1000)
    os._exit(code)        # skip interpreter teardown: the executor thread may be mid-op
