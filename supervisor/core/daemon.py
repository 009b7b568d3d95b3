"""The supervisor process: composition of the run files, the process table, the router, the
event log, the command bus and the two sockets — and the one loop that owns every socket.

    while running:
        run what other threads submitted (HTTP handlers, signals) — they only enqueue
        tick the process table (reap · kill deadlines · liveness · policy timers)
        pump the router (send what waits for a ready worker · expire deadlines)
        wait ≤ 100 ms for worker / control / wake-up traffic

Front ends never touch a socket: HTTP threads and signal handlers put work on `inbox` and write
a byte to a wake-up pipe; the CLI reaches the same commands over the control socket. Commands
that read files or processes run off the loop (commands.OFF_LOOP), so a slow disk never delays a
liveness check.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import zmq

from kiln.protocol.store.adapter_registry import AdapterRegistry
from kiln.protocol import make

from . import registry as commands
from . import policy, segments
from .config import Config, kv_types
from .events import EventLog
from .paths import Paths
from .process_table import ProcessTable, SystemClock, WorkerProcess
from .processes import ProcessSpawner
from .router import Router
from .run_files import AlreadyRunning, RunFiles, read_pid  # noqa: F401  (re-exported for the CLI)
from .sockets import SocketTraffic

HANDLED_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
LOOP_WAIT = 0.1          # the loop's longest wait for traffic, seconds
# a loop on time ticks the table at least this often; a longer gap is the supervisor's own lateness
# (not scheduled, or a blocking call), which the table does not count as the workers' silence
MAX_TICK_GAP = 2.5 * LOOP_WAIT


def make_placer(table, m: dict, busy, record, state_file):
    """The placer with its settings resolved: budget and pressure in bytes, keep_alive in s."""
    import psutil

    from kiln.native.models.library import resolve_model
    from kiln.native.models.plan import plan

    from .placer import Placer
    from .units import parse_duration
    from .plan_cache import PlanCache
    from .units import parse_size
    vm = psutil.virtual_memory()
    pressure = parse_size(m["min_available"], vm.total)
    budget = max(0, vm.available - pressure) if m["memory_budget"] == "auto" else parse_size(m["memory_budget"], vm.total)
    if not m["on_demand"]:
        return None
    budget_bytes = budget              # the plan's `available` (its `budget` sizes a context)
    return Placer(table, budget=budget, max_loaded=m["max_loaded"], keep_alive=parse_duration(m["keep_alive"]),
                  pressure_bytes=pressure, busy=busy, record=record, resolve=resolve_model,
                  plan=PlanCache(lambda path, ctx, parallel=None, draft=None, budget=None, kv=("f16", "f16"), mmproj=None:
                                 plan(path, ctx, available=budget_bytes, parallel=parallel, draft=draft, budget=budget,
                                      kv=kv, mmproj=mmproj)),
                  available=lambda: psutil.virtual_memory().available, ctx=m["ctx"] or None, state_file=state_file,
                  weights=m["weights"], kv=kv_types(m))


class Supervisor(SocketTraffic):
    def __init__(self, config: Config, paths: Paths, clock=SystemClock, front_end=None):
        """`front_end(supervisor) -> (server, (host, port))` starts the HTTP server once the
        sockets are bound (supervisor/serve.py passes the HTTP app's)."""
        self.cfg, self.paths = config, paths
        self.front_end = front_end
        sv, srv = config["supervisor"], config["server"]
        self.files = RunFiles(paths)
        self.keys = None                        # CURVE keys: workers on other machines (the Ray backend)
        self.events = EventLog()
        self.adapters = AdapterRegistry(paths.home)
        self.table = ProcessTable(
            config.workers,
            policy.Settings(sv["start_secs"], sv["max_restarts"], sv["restart_window"], sv["backoff_initial"],
                            sv["backoff_max"], sv["boot_timeout"], sv["stable_secs"]),
            self._spawner(config, paths), clock,
            heartbeat_interval=sv["heartbeat_interval"], liveness=sv["liveness"],
            progress_timeout=sv["progress_timeout"], max_tick_gap=MAX_TICK_GAP,
            graceful_timeout=sv["graceful_timeout"], record=self.record,
            send_shutdown=lambda w: w.identity and self._send(self.worker_sock, w.identity, make("shutdown")),
            on_exit=lambda w, how: self.router.on_worker_exit(w, how),
            on_ready=lambda w: self.router.pump())
        self.router = Router(self.table, lambda w, m: self._send(self.worker_sock, w.identity, m),
                             max_queue=srv["max_queue"], wait_for_worker=srv["wait_for_worker"],
                             request_timeout=srv["request_timeout"], adapters=self.adapters, record=self.record,
                             on_loop=self.submit)
        self.placer = self.router.placer = make_placer(self.table, config["models"], self.router.busy, self.record,
                                                       paths.home / "state" / "models.json")
        if self.placer is not None and config["models"]["pull_on_demand"]:
            from .hub_fetch import HubFetch
            self.router.fetch = HubFetch(lambda: self.placer.budget, self.record)
        self.bad_frames: Counter = Counter()
        self.inbox: queue.Queue = queue.Queue()
        self.offloop = ThreadPoolExecutor(4, thread_name_prefix="kiln-cmd")
        self.shutting_down = False
        self.drain_until: float | None = None    # a shutdown waiting for requests in flight
        self._signals: list[int] = []            # appended by signal handlers, drained by the loop
        self.started_at = time.time()
        self.http = None
        self.http_address: tuple[str, int] | None = None
        self.segments: list = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _spawner(self, config: Config, paths: Paths):
        """Local subprocesses, or Ray actors on a cluster's nodes ([cluster] backend)."""
        sv, cl = config["supervisor"], config["cluster"]
        if cl["backend"] != "ray":
            return ProcessSpawner(paths, sv["heartbeat_interval"])
        from .curve_keys import WorkerKeys
        from .ray_spawner import RaySpawner
        self.keys = WorkerKeys()

        def need(name: str) -> int:
            """A worker's planned bytes; a later pipeline stage's, its first stage's share."""
            placer = getattr(self, "placer", None)
            if placer is None or name not in self.table:
                return 0
            l = placer.loaded.get(self.table[name].spec.get("pipeline") or name)
            return l.planned_bytes if l is not None else 0
        return RaySpawner(paths, sv["heartbeat_interval"], cl["address"], self.keys, self.files.worker_key,
                          need=need, record=self.record, files=cl["files"], node_store=cl["node_store"])

    def _bind_worker_socket(self) -> None:
        """ipc:// on one machine; with the Ray backend, TCP with CURVE on the address the nodes
        reach this one by (the cluster joined first: its error is the one to read)."""
        if self.keys is None:
            path = self.files.bind_path(self.paths.worker_endpoint)
            self.worker_sock.bind(self.paths.worker_endpoint)
            os.chmod(path, 0o600)
            return
        spawner, cl = self.table.spawner, self.cfg["cluster"]
        spawner.connect()
        self.keys.start()
        self.keys.serve_on(self.worker_sock)
        host = cl["bind"] or spawner.node_ip()
        self.worker_sock.bind(f"tcp://{'[' + host + ']' if ':' in host else host}:{cl['port'] or '*'}")
        spawner.endpoint = self.worker_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.placer is not None:
            # models placed on the nodes: the budget is the cluster's, each one fitted to nodes
            self.placer.nodes_free = spawner.free
            self.placer.budget = sum(n.memory for n in spawner.nodes())
        self.record("cluster_joined", None, f"Ray at {cl['address']}: {len(spawner.nodes())} node(s); workers "
                                            f"connect to {spawner.endpoint} (CURVE)")

    def cluster_status(self) -> dict:
        if self.keys is None:
            return {"backend": "local"}
        return {"backend": "ray", "address": self.cfg["cluster"]["address"], **self.table.spawner.describe(),
                "server_key": self.keys.public.decode(), "refused_keys": self.keys.refused}

    # -- what the commands see ----------------------------------------------------------------

    @property
    def workers(self) -> dict[str, WorkerProcess]:
        return self.table.workers

    @property
    def pending(self) -> dict:
        return self.router.pending

    def record(self, event: str, worker: str | None, detail: str, **extra) -> None:
        self.events.record(event, worker, detail, **extra)

    def apply(self, w: WorkerProcess, event) -> None:
        self.table.apply(w, event)

    # -- thread-safe entry points -------------------------------------------------------------

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self.inbox.put((fn, fut))
        self._wake()
        return fut

    def command(self, name: str, args: dict | None = None, timeout: float = 15.0) -> Any:
        """Run a bus command and wait for its result (from a thread that is not the loop)."""
        if name in commands.OFF_LOOP:
            return commands.run(self, name, args or {})
        if name == "load" and self.placer is not None and isinstance((args or {}).get("model"), str):
            self.placer.prepare(args["model"])
        return self.submit(lambda: commands.run(self, name, args or {})).result(timeout)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass

    # -- lifecycle ----------------------------------------------------------------------------

    def serve(self, on_ready: Callable[[], None] | None = None) -> int:
        # private by default: what the daemon and its workers write (training data, eval results,
        # sessions, logs) is the user's alone; what an earlier Kiln left readable is fixed once
        os.umask(0o077)
        self.files.acquire()
        fixed = self.paths.make_private()
        if fixed:
            self.record("made_private", None, f"{len(fixed)} files and folders under {self.paths.home} were readable "
                        f"by others; now 0600/0700 (e.g. {fixed[0]})")
        self.segments = segments.make_for_workers(self.paths.home, self.table, self.record)
        if self.placer is not None:
            self.placer.plan_pinned()                # after the segments: a moe-stream cache is sized
        ctx = zmq.Context.instance()
        self.worker_sock = ctx.socket(zmq.ROUTER)
        self.worker_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.worker_sock.setsockopt(zmq.LINGER, 0)
        self.control = ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        path = self.files.bind_path(self.paths.control_endpoint)
        self.control.bind(self.paths.control_endpoint)
        os.chmod(path, 0o600)
        self._bind_worker_socket()
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, self._on_signal)
        # A mask inherited from whoever started us (some CI runners and shells block SIGTERM) would
        # leave the signal pending forever: `kill <pid>` must always stop the daemon.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS | {signal.SIGUSR1})
        faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1`: stacks to the log
        try:
            self._start_http()
            self.record("daemon_started", None, f"pid {os.getpid()}, http {self.http_address}")
            for w in self.table:
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
                if self.drain_until is not None:
                    self.stop_everything()
                self.table.kill_all()
            else:
                commands.run(self, "shutdown", {"reason": name})

    def _start_http(self) -> None:
        if self.front_end is not None:
            self.http, self.http_address = self.front_end(self)

    def stop_everything(self) -> None:
        """The end of a shutdown: what is still in flight is cut, every worker stopped."""
        self.drain_until = None
        self.router.fail_all("shutting_down", "kiln is shutting down")
        for w in self.workers.values():
            self.apply(w, policy.Stop())

    def _teardown(self) -> None:
        self.router.fail_all("shutting_down", "kiln is shutting down")
        self.table.kill_all()
        for w in self.table:
            if w.proc is not None:
                try:
                    w.proc.wait(5)
                except Exception:  # noqa: BLE001
                    pass
        if self.http:
            self.http.close()
        if self.keys is not None:
            self.table.spawner.shutdown()
            self.keys.stop()
        self.offloop.shutdown(wait=False, cancel_futures=True)
        for sock in (getattr(self, "worker_sock", None), getattr(self, "control", None)):
            if sock is not None:
                sock.close(linger=0)
        self.files.release(self.segments)
        self.record("daemon_stopped", None, "")

    # -- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.worker_sock, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        housekeeping = 0.0
        while True:
            self._handle_signals()
            self._drain_inbox()
            now = time.monotonic()
            if now - housekeeping >= 0.02:      # not once per message: traffic stays cheap
                housekeeping = now
                self.table.tick()
                if self.placer is not None:
                    self.placer.tick()
                self.router.pump()
            if self.drain_until is not None and (not self.router.pending or now >= self.drain_until):
                left = len(self.router.pending)
                self.record("drained", None, "every request in flight finished" if not left else
                            f"{left} request(s) still in flight after drain_timeout: cut")
                self.stop_everything()
            if self.shutting_down and self.drain_until is None and not self.table.any_alive():
                return
            ready = dict(poller.poll(LOOP_WAIT * 1000))
            if self._wake_r in ready:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            for sock, handle in ((self.worker_sock, self._on_worker_frames), (self.control, self._on_control_frames)):
                if sock in ready:
                    for _ in range(1000):            # bounded, so a flood cannot starve the rest
                        if not sock.poll(0):
                            break
                        if sock is self.worker_sock and self.keys is not None:
                            frames = sock.recv_multipart(copy=False)
                            handle([f.bytes for f in frames], frames[-1].get("User-Id"))
                        else:
                            handle(sock.recv_multipart())

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
