"""The supervisor process: one loop that owns every socket and every worker.

    while running:
        run what other threads submitted (HTTP handlers, signals) — they only enqueue
        reap exited workers · kill unresponsive ones · advance the restart policy
        expire deadlines · wait ≤ 100 ms for worker / control / wake-up traffic

Front ends never touch a socket: the HTTP threads and signal handlers put work on `inbox` and
write a byte to a wake-up pipe; the CLI reaches the same commands over the control socket.
Requests to workers are proxied: the supervisor gives each a fresh id, remembers who asked,
forwards `chunk`/`reply`/`error` back, and answers `worker_crashed` for every request in flight
on a worker that dies.
"""

from __future__ import annotations

import faulthandler
import fcntl
import logging
import os
import queue
import signal
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from kiln.native.adapter_registry import AdapterNotFound, AdapterRegistry
from kiln.protocol import Message, ProtocolError, decode_frames, encode_frames, make, new_id, version_error

from . import commands, eval_commands, policy, train_commands  # noqa: F401  (they register bus commands)
from .config import Config
from .paths import Paths
from .processes import WorkerProcess

log = logging.getLogger("kiln.supervisor")

HANDLED_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


class AlreadyRunning(RuntimeError):
    def __init__(self, pid: int | None):
        super().__init__(f"kiln is already running (pid {pid})" if pid else "kiln is already running")
        self.pid = pid


@dataclass
class LocalCall:
    """A request to a worker from an in-process front end; messages arrive on `events`."""
    worker: str
    op: str
    body: Any
    timeout: float
    id: str = field(default_factory=new_id)
    events: queue.Queue = field(default_factory=queue.Queue)
    supervisor: Any = None

    def cancel(self) -> None:
        self.supervisor.submit(lambda: self.supervisor.cancel_request(self.id, notify=False))


@dataclass
class Pending:
    worker: str
    client: tuple                    # ("control", identity, client id) | ("local", LocalCall)
    deadline: float                  # monotonic
    got_output: bool = False
    adapter: str | None = None       # the LoRA the request runs with (delete refuses it meanwhile)


def read_pid(paths: Paths) -> int | None:
    try:
        return int(paths.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


class Supervisor:
    def __init__(self, config: Config, paths: Paths):
        self.cfg, self.paths = config, paths
        sv = config["supervisor"]
        self.policy = policy.Settings(sv["start_secs"], sv["max_restarts"], sv["restart_window"],
                                      sv["backoff_initial"], sv["backoff_max"], sv["boot_timeout"])
        self.workers = {n: WorkerProcess(n, spec) for n, spec in config.workers.items()}
        self.by_identity: dict[bytes, str] = {}
        self.pending: dict[str, Pending] = {}
        self.adapters = AdapterRegistry(paths.home)
        self.bad_frames: Counter = Counter()
        self.events: deque = deque(maxlen=500)
        self.inbox: queue.Queue = queue.Queue()
        self.shutting_down = False
        self._signals: list[int] = []            # appended by signal handlers, drained by the loop
        self.started_at = time.time()
        self.key = os.urandom(32)
        self.http = None
        self.http_address: tuple[str, int] | None = None
        self._lock_fd: int | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- thread-safe entry points -------------------------------------------------------------

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self.inbox.put((fn, fut))
        self._wake()
        return fut

    def command(self, name: str, args: dict | None = None, timeout: float = 15.0) -> Any:
        """Run a bus command on the supervisor's loop and wait for its result."""
        return self.submit(lambda: commands.run(self, name, args or {})).result(timeout)

    def call(self, worker: str, op: str, body: Any = None, timeout: float | None = None) -> LocalCall:
        c = LocalCall(worker, op, body, timeout or self.cfg["server"]["request_timeout"], supervisor=self)
        self.submit(lambda: self.start_request(c.worker, c.op, c.body, c.timeout, ("local", c), c.id))
        return c

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass

    # -- lifecycle ----------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the single-instance lock and write the pidfile, or raise AlreadyRunning."""
        self.paths.ensure()
        fd = os.open(self.paths.lockfile, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(read_pid(self.paths)) from None
        self._lock_fd = fd
        self.paths.pidfile.write_text(f"{os.getpid()}\n")
        fdk = os.open(self.paths.keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fdk, self.key)
        os.close(fdk)
        os.chmod(self.paths.keyfile, 0o600)

    def _make_segments(self) -> None:
        """Expert-cache segments for moe-stream workers, sized from their model and budget;
        stale ones of a killed daemon are removed first."""
        import psutil

        from kiln.native.expert_store import ExpertStore, segment_bytes
        from kiln.native.gguf_file import GGUFError, read_gguf
        from kiln.native.library import ModelNotFound, resolve_model

        from . import segments
        stale = segments.remove_stale(self.paths.home)
        if stale:
            self.record("stale_segments_removed", None, ", ".join(stale))
        self.segments = []
        for w in self.workers.values():
            if w.kind != "moe-stream":
                continue
            try:
                path = resolve_model(w.spec["model"])
                budget = segments.parse_size(w.spec["settings"].get("expert_cache", "25%"),
                                             psutil.virtual_memory().total)
                store = ExpertStore(path)
                slots, size = segment_bytes(read_gguf(path, skip_arrays=True), store, budget)
                store.close()
            except (ModelNotFound, GGUFError, ValueError, OSError) as e:
                self.record("segment_failed", w.name, str(e))
                continue                       # the worker then fails at boot with a clear reason
            seg = segments.create(self.paths.home, w.name, size)
            self.segments.append(seg)
            w.spec = dict(w.spec, settings={**w.spec["settings"], "shm": str(seg), "shm_slots": slots})
            self.record("segment_created", w.name, f"{seg.name}: {slots} expert slots, {size / 2**20:.1f} MiB")

    def serve(self, on_ready: Callable[[], None] | None = None) -> int:
        self.acquire()
        self._make_segments()
        ctx = zmq.Context.instance()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.control = ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        for sock, ep in ((self.router, self.paths.worker_endpoint), (self.control, self.paths.control_endpoint)):
            path = ep[len("ipc://"):]
            if os.path.exists(path):
                os.unlink(path)          # stale socket of a killed daemon: we hold the lock
            sock.bind(ep)
            os.chmod(path, 0o600)
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, self._on_signal)
        # A mask inherited from whoever started us (some CI runners and shells block SIGTERM) would
        # leave the signal pending forever: `kill <pid>` must always stop the daemon.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS | {signal.SIGUSR1})
        faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1`: stacks to the log
        try:
            self._start_http()
            self.record("daemon_started", None, f"pid {os.getpid()}, http {self.http_address}")
            for w in self.workers.values():
                if w.spec.get("enabled", True):
                    self.apply(w, policy.Start(manual=False))
            if on_ready:
                on_ready()
            self._loop()
        finally:
            self._teardown()
        return 0

    def _on_signal(self, signum, _frame) -> None:
        # Handlers only note the signal and wake the loop (gunicorn), taking no lock: a handler
        # runs between two bytecodes of the main thread, which may hold the inbox's lock then.
        self._signals.append(signum)
        self._wake()

    def _handle_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                self.record("sighup", None, "ignored (no reload yet)")
            elif self.shutting_down:
                self.record("signal", None, f"{name} again while stopping: killing the workers now")
                for w in self.workers.values():
                    w.kill()
            else:
                commands.run(self, "shutdown", {"reason": name})

    def _start_http(self) -> None:
        from .http_app import serve_http
        self.http, self.http_address = serve_http(self)

    def _teardown(self) -> None:
        for w in self.workers.values():
            w.kill()
            if w.proc:
                try:
                    w.proc.wait(5)
                except Exception:  # noqa: BLE001
                    pass
        if self.http:
            self.http.close()
        for sock in (getattr(self, "router", None), getattr(self, "control", None)):
            if sock is not None:
                sock.close(linger=0)
        for p in [self.paths.run / "workers.sock", self.paths.run / "control.sock",
                  self.paths.keyfile, self.paths.pidfile] + getattr(self, "segments", []):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self.record("daemon_stopped", None, "")

    # -- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        housekeeping = 0.0
        while True:
            self._handle_signals()
            self._drain_inbox()
            now = time.monotonic()
            if now - housekeeping >= 0.02:      # not once per message: traffic stays cheap
                housekeeping = now
                self._reap()
                self._check_liveness()
                self._tick()
                self._expire_requests()
            if self.shutting_down and not any(w.ps.state in policy.ALIVE for w in self.workers.values()):
                return
            ready = dict(poller.poll(100))
            if self._wake_r in ready:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self.router in ready:
                for _ in range(1000):            # bounded, so a flood cannot starve the rest
                    if not self.router.poll(0):
                        break
                    self._on_worker_frames(self.router.recv_multipart())
            if self.control in ready:
                for _ in range(1000):
                    if not self.control.poll(0):
                        break
                    self._on_control_frames(self.control.recv_multipart())

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, fut = self.inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered to the caller's thread
                fut.set_exception(e)

    def record(self, event: str, worker: str | None, detail: str) -> None:
        self.events.append({"ts": time.time(), "event": event, "worker": worker, "detail": detail})
        log.info("%s%s %s", f"[{worker}] " if worker else "", event, detail)

    # -- worker state machine -----------------------------------------------------------------

    def apply(self, w: WorkerProcess, event) -> None:
        before = w.ps.state
        w.ps, actions = policy.step(w.ps, event, time.time(), self.policy)
        if w.ps.state != before:
            detail = w.ps.reason or ""
            if w.ps.state == "backoff":
                detail = f"restart in {w.ps.retry_at - time.time():.1f} s"
            self.record(w.ps.state, w.name, detail)
        for action in actions:
            if action[0] == "spawn":
                try:
                    w.spawn(self.paths, self.paths.worker_endpoint, self.cfg["supervisor"]["heartbeat_interval"])
                except OSError as e:
                    self.apply(w, policy.SpawnFailed(str(e)))
                    continue
                self.record("spawned", w.name, f"pid {w.pid}")
                self.apply(w, policy.Spawned())
            elif action[0] == "terminate":
                if w.identity:
                    self._send(self.router, w.identity, make("shutdown"))
                w.terminate(self.cfg["supervisor"]["graceful_timeout"])
            elif action[0] == "kill":
                self.record("killed", w.name, action[1])
                w.kill()

    def _reap(self) -> None:
        for w in self.workers.values():
            if w.kill_at is not None and time.monotonic() >= w.kill_at:
                self.record("killed", w.name, "did not exit within graceful_timeout")
                w.kill()
                w.kill_at = None
            identity = w.identity
            result = w.reap()
            if result is None:
                continue
            code, sig = result
            if identity:
                self.by_identity.pop(identity, None)
            reason = w.boot_reason
            if code == policy.EXIT_BOOT_ERROR and not reason:
                reason = w.last_log_line(self.paths)
            how = f"code {code}" if sig is None else f"signal {sig} ({signal.Signals(sig).name})"
            self.record("exited", w.name, how + (f": {reason}" if reason else ""))
            self._fail_pending(w.name, how)
            self.apply(w, policy.Exited(code, sig, reason))

    def _check_liveness(self) -> None:
        sv = self.cfg["supervisor"]
        limit = sv["liveness"] * sv["heartbeat_interval"]
        now = time.monotonic()
        for w in self.workers.values():
            if w.pid and w.identity and w.ps.state in ("starting", "running") and w.kill_at is None \
                    and now - w.last_heartbeat > limit:
                self.apply(w, policy.Unresponsive(
                    f"missed {sv['liveness']} heartbeats (none for {now - w.last_heartbeat:.1f} s)"))

    def _tick(self) -> None:
        for w in self.workers.values():
            self.apply(w, policy.Tick())

    # -- worker traffic -----------------------------------------------------------------------

    def _send(self, sock, identity: bytes, msg: Message) -> None:
        sock.send_multipart([identity] + encode_frames(msg, self.key))

    def _decode(self, sock, frames: list[bytes]) -> tuple[bytes, Message | None]:
        """(identity, message), or (identity, None) for a refused frame — counted, and a peer of
        another protocol version is told which one this is."""
        identity = frames[0]
        try:
            return identity, decode_frames(frames[1:], self.key)
        except ProtocolError as e:
            self.bad_frames[e.kind] += 1
            if e.kind == "version":
                sock.send_multipart([identity] + version_error(e.peer_version, self.key))
            return identity, None

    def _on_worker_frames(self, frames: list[bytes]) -> None:
        identity, msg = self._decode(self.router, frames)
        if msg is None:
            return
        if msg.type == "hello":
            self._on_hello(identity, msg)
            return
        name = self.by_identity.get(identity)
        if name is None:
            self.bad_frames["unknown_peer"] += 1
            return
        w = self.workers[name]
        if msg.type == "heartbeat":
            w.last_heartbeat = time.monotonic()
            if isinstance(msg.body, dict):
                w.status = msg.body
        elif msg.type in ("chunk", "reply", "error"):
            if msg.type == "error" and msg.get("code") == "boot_failed":
                w.boot_reason = msg.get("message")
                return
            self._to_client(msg)

    def _on_hello(self, identity: bytes, msg: Message) -> None:
        name, pid = msg.get("name"), msg.get("pid")
        w = self.workers.get(name)
        if w is None or w.pid != pid or identity != f"{name}:{pid}".encode():
            self.bad_frames["unknown_peer"] += 1
            return
        w.identity = identity
        w.hello = {k: msg.get(k) for k in ("kind", "ops", "protocol")}
        w.last_heartbeat = time.monotonic()
        if isinstance(msg.body, dict):
            w.status = msg.body
        self.by_identity[identity] = name
        self.record("hello", name, f"pid {pid}, ops {', '.join(w.hello['ops'] or [])}")
        self.apply(w, policy.Hello())

    # -- requests -----------------------------------------------------------------------------

    def start_request(self, worker: str, op: str, body: Any, timeout: float, client: tuple,
                      rid: str | None = None) -> None:
        rid = rid or new_id()
        w = self.workers.get(worker)
        if w is None:
            return self._reply_error(client, "unknown_worker",
                                     f"no worker named {worker!r} (workers: {', '.join(self.workers) or 'none'})")
        if self.shutting_down:
            return self._reply_error(client, "shutting_down", "kiln is shutting down", retryable=True)
        if not w.identity or w.ps.state not in ("starting", "running"):
            return self._reply_error(client, "worker_unavailable",
                                     f"worker {worker} is {w.ps.state}" + (f": {w.ps.reason}" if w.ps.reason else ""),
                                     retryable=w.ps.state not in ("fatal", "stopped"))
        adapter = None
        if op in ("generate", "score") and w.kind in ("inference", "moe-stream") and isinstance(body, dict):
            adapter = body.get("adapter")
            if adapter is None:                      # the active adapter applies unless one is named
                adapter = self.adapters.active()
                if adapter:
                    body = {**body, "adapter": adapter}
            elif adapter:
                try:
                    self.adapters.get(adapter)
                except (AdapterNotFound, ValueError) as e:
                    return self._reply_error(client, "adapter_not_found", str(e))
        self.pending[rid] = Pending(worker, client, time.monotonic() + timeout, adapter=adapter or None)
        self._send(self.router, w.identity, make("request", id=rid, op=op, body=body,
                                                 deadline=time.time() + timeout))

    def cancel_request(self, rid: str, notify: bool = True) -> None:
        p = self.pending.pop(rid, None)
        if p is None:
            return
        w = self.workers.get(p.worker)
        if w and w.identity:
            self._send(self.router, w.identity, make("cancel", id=rid))
        if notify:
            self._reply_error(p.client, "cancelled", "cancelled")

    def _to_client(self, msg: Message) -> None:
        p = self.pending.get(msg.id)
        if p is None:
            return                       # cancelled or expired: late traffic is expected
        if msg.type == "chunk":
            p.got_output = True
        else:
            del self.pending[msg.id]
        if p.client[0] == "local":
            p.client[1].events.put(msg)
        else:
            _, identity, client_id = p.client
            fields = {k: v for k, v in msg.header.items() if k not in ("type", "id", "ts")}
            self._send(self.control, identity, make(msg.type, id=client_id, body=msg.body,
                                                    buffers=msg.buffers, **fields))

    def _reply_error(self, client: tuple, code: str, message: str, retryable: bool = False) -> None:
        if client[0] == "local":
            client[1].events.put(make("error", id=client[1].id, code=code, message=message, retryable=retryable))
        else:
            self._send(self.control, client[1], make("error", id=client[2], code=code, message=message,
                                                     retryable=retryable))

    def _fail_pending(self, worker: str, how: str) -> None:
        for rid, p in list(self.pending.items()):
            if p.worker == worker:
                del self.pending[rid]
                self._reply_error(p.client, "worker_crashed", f"worker {worker} died ({how}) during the request",
                                  retryable=not p.got_output)

    def _expire_requests(self) -> None:
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            if now > p.deadline:
                self.cancel_request(rid, notify=False)
                self._reply_error(p.client, "deadline_exceeded", "the request took longer than its deadline")

    # -- control socket (CLI) -----------------------------------------------------------------

    def _on_control_frames(self, frames: list[bytes]) -> None:
        identity, msg = self._decode(self.control, frames)
        if msg is None:
            return
        if msg.type == "cancel":
            for rid, p in list(self.pending.items()):
                if p.client[0] == "control" and p.client[1] == identity and p.client[2] == msg.id:
                    self.cancel_request(rid, notify=False)
            return
        if msg.type != "request":
            self.bad_frames["unexpected_type"] += 1
            return
        op = msg.get("op")
        body = msg.body if isinstance(msg.body, dict) else {}
        if op == "call":
            timeout = body.get("timeout") or self.cfg["server"]["request_timeout"]
            if not isinstance(body.get("worker"), str) or not isinstance(body.get("op"), str) \
                    or not isinstance(timeout, (int, float)):
                return self._reply_error(("control", identity, msg.id), "bad_request",
                                         "call needs {worker: str, op: str, body?, timeout?: number}")
            return self.start_request(body["worker"], body["op"], body.get("body"), float(timeout),
                                      ("control", identity, msg.id))
        try:
            result = commands.run(self, op, body)
        except commands.CommandError as e:
            self._send(self.control, identity, make("error", id=msg.id, code=e.code, message=e.message))
            return
        self._send(self.control, identity, make("reply", id=msg.id, body=result))
