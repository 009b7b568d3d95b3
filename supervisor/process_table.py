"""The process table: every worker's process, its lifecycle state, and the timers that watch it.

It carries out the restart policy's decisions (spawn, terminate, kill) through a *spawner* and
feeds back what happened (spawned, hello, exited, missed heartbeats). Every timer — heartbeat
liveness, SIGTERM→SIGKILL, backoff, start_secs — runs on the injected clock's monotonic time, so
the fast tests drive the whole table with a fake spawner and a fake clock, as supervisord's do.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.protocol.vocab import ALIVE, FATAL, RUNNING, STARTING, STOPPED, WORKER_LOADING, serving

from . import policy
from .processes import sample


MAX_STOP_GRACE = 120.0          # the longest a worker may ask to wind down


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


@dataclass
class WorkerProcess:
    name: str
    spec: dict                                   # the [workers.<name>] table, validated
    ps: policy.ProcState = field(default_factory=policy.ProcState)
    proc: Any = None                             # the spawner's handle (pid, poll, send_signal)
    identity: bytes | None = None                # ROUTER identity after hello: b"name:pid"
    hello: dict | None = None                    # kind, ops, protocol
    last_heartbeat: float = 0.0                  # monotonic
    status: dict = field(default_factory=dict)   # the last heartbeat's body (state, stats)
    started_wall: float | None = None
    kill_at: float | None = None                 # SIGKILL deadline after a SIGTERM (monotonic)
    boot_reason: str | None = None               # from an `error boot_failed` message
    rss: int | None = None                       # sampled by the table, not per request
    cpu: float | None = None

    @property
    def kind(self) -> str:
        return self.spec["kind"]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def worker_state(self) -> str | None:
        """What the process last said it was doing; None once there is no process (its last
        stats stay in `status`, its last state would be a lie: `stopped/loading`)."""
        return self.status.get("state") if self.proc is not None else None

    def can_serve(self) -> bool:
        """Hello received and not loading: a request sent now is answered by this process."""
        return self.identity is not None and serving(self.ps.state, self.worker_state)

    def describe(self, now_wall: float) -> dict:
        ps = self.ps
        up = now_wall - self.started_wall if self.pid and self.started_wall else None
        return {
            "name": self.name, "kind": self.kind, "state": ps.state, "pid": self.pid,
            "uptime_s": round(up, 3) if up is not None else None,
            "restarts": ps.restarts, "last_exit": ps.last_exit, "reason": ps.reason,
            "rss_bytes": self.rss if self.pid else None, "cpu_percent": self.cpu if self.pid else None,
            "worker_state": self.worker_state,
            "stats": {k: v for k, v in self.status.items() if k != "state"},
            "ops": (self.hello or {}).get("ops", []),
            "model": self.spec.get("model") if self.kind != "test" else None,
        }


class ProcessTable:
    """Workers by name. `tick()` is called by the daemon's loop; the hooks tell the rest of the
    supervisor what happened: `record(event, worker, detail)`, `send_shutdown(worker)`,
    `on_exit(worker, how)` (the router fails or retries that worker's requests)."""

    def __init__(self, workers: dict[str, dict], settings: policy.Settings, spawner, clock=SystemClock,
                 heartbeat_interval: float = 1.0, liveness: int = 3, graceful_timeout: float = 5.0,
                 record: Callable[[str, str | None, str], None] = lambda *a: None,
                 send_shutdown: Callable[[WorkerProcess], None] = lambda w: None,
                 on_exit: Callable[[WorkerProcess, str], None] = lambda w, how: None,
                 on_ready: Callable[[WorkerProcess], None] = lambda w: None):
        self.workers = {n: WorkerProcess(n, spec) for n, spec in workers.items()}
        self.settings, self.spawner, self.clock = settings, spawner, clock
        self.heartbeat_interval, self.liveness, self.graceful_timeout = heartbeat_interval, liveness, graceful_timeout
        self.record, self.send_shutdown, self.on_exit, self.on_ready = record, send_shutdown, on_exit, on_ready
        self.by_identity: dict[bytes, str] = {}
        self._psutil: dict = {}
        self._sampled_at = -1e9

    def __iter__(self):
        return iter(self.workers.values())

    def __contains__(self, name: str) -> bool:
        return name in self.workers

    def __getitem__(self, name: str) -> WorkerProcess:
        return self.workers[name]

    def add(self, name: str, spec: dict) -> WorkerProcess:
        """A worker placed at run time (a model loaded on demand); started by whoever added it."""
        if name in self.workers:
            raise ValueError(f"a worker named {name!r} exists")
        w = self.workers[name] = WorkerProcess(name, spec)
        return w

    def remove(self, name: str) -> None:
        """Forget a stopped worker (a model unloaded)."""
        w = self.workers.get(name)
        if w is None:
            return
        if w.proc is not None:
            raise ValueError(f"worker {name} still has a process (pid {w.pid})")
        del self.workers[name]
        self._psutil.pop(name, None)

    def any_alive(self) -> bool:
        return any(w.ps.state in ALIVE for w in self.workers.values())

    # -- decisions in, actions out ------------------------------------------------------------

    def apply(self, w: WorkerProcess, event) -> None:
        before = w.ps.state
        now = self.clock.monotonic()
        w.ps, actions = policy.step(w.ps, event, now, self.settings)
        if w.ps.state != before:
            detail = w.ps.reason or ""
            self.record(w.ps.state, w.name, detail)
            if w.ps.state == RUNNING and w.can_serve():
                self.on_ready(w)
        for action in actions:
            if action[0] == "spawn":
                self._spawn(w)
            elif action[0] == "terminate":
                self.send_shutdown(w)
                self._signal(w, signal.SIGTERM, signal.SIGCONT)   # SIGCONT: a stopped process can act
                w.kill_at = now + self.grace(w)
            elif action[0] == "kill":
                self.record("killed", w.name, action[1])
                self._signal(w, signal.SIGKILL)

    def grace(self, w: WorkerProcess) -> float:
        """Seconds between SIGTERM and SIGKILL: graceful_timeout, or longer when the worker said
        in its hello that it needs longer to wind down (the trainer writes a checkpoint), capped."""
        asked = (w.hello or {}).get("stop_grace")
        return max(self.graceful_timeout, min(float(asked), MAX_STOP_GRACE)) \
            if isinstance(asked, (int, float)) else self.graceful_timeout

    def _spawn(self, w: WorkerProcess) -> None:
        try:
            w.proc = self.spawner.spawn(w.name, w.spec)
        except OSError as e:
            self.apply(w, policy.SpawnFailed(str(e)))
            return
        w.identity, w.hello, w.status, w.boot_reason, w.kill_at = None, None, {}, None, None
        w.last_heartbeat = self.clock.monotonic()
        w.started_wall = self.clock.time()
        self.record("spawned", w.name, f"pid {w.pid}")
        self.apply(w, policy.Spawned())

    def _signal(self, w: WorkerProcess, *sigs: int) -> None:
        if w.proc is None:
            return
        for sig in sigs:
            try:
                w.proc.send_signal(sig)
            except (ProcessLookupError, OSError):
                pass

    def kill_all(self) -> None:
        for w in self.workers.values():
            self._signal(w, signal.SIGKILL)

    # -- what the loop calls ------------------------------------------------------------------

    def tick(self) -> None:
        now = self.clock.monotonic()
        self._reap(now)
        self._check_liveness(now)
        for w in self.workers.values():
            self.apply(w, policy.Tick())
        if now - self._sampled_at >= 1.0:          # psutil once a second, never per request
            self._sampled_at = now
            for w in self.workers.values():
                if w.pid:
                    w.rss, w.cpu = sample(w.pid, self._psutil.setdefault(w.name, {}))

    def _reap(self, now: float) -> None:
        for w in self.workers.values():
            if w.proc is None:
                continue
            if w.kill_at is not None and now >= w.kill_at:
                self.record("killed", w.name, "did not exit within graceful_timeout")
                self._signal(w, signal.SIGKILL)
                w.kill_at = None
            rc = w.proc.poll()
            if rc is None:
                continue
            code, sig = (rc, None) if rc >= 0 else (None, -rc)
            w.proc, w.kill_at = None, None
            if w.identity:
                self.by_identity.pop(w.identity, None)
            w.identity = None
            reason = w.boot_reason
            if code == policy.EXIT_BOOT_ERROR and not reason:
                last_line = getattr(self.spawner, "last_log_line", None)
                reason = last_line(w.name) if last_line else None
            how = f"code {code}" if sig is None else f"signal {sig} ({signal.Signals(sig).name})"
            self.record("exited", w.name, how + (f": {reason}" if reason else ""))
            self.on_exit(w, how)
            self.apply(w, policy.Exited(code, sig, reason))

    def _check_liveness(self, now: float) -> None:
        beats = self.liveness * self.heartbeat_interval
        for w in self.workers.values():
            if not (w.pid and w.identity and w.ps.state in (STARTING, RUNNING) and w.kill_at is None):
                continue
            # A worker that says it is loading a model may miss heartbeats honestly: parsing a
            # vocabulary holds the GIL for a tenth of a second at a time on an idle machine, much
            # longer on a busy one (the tokenizers library's builders). It has boot_timeout to
            # speak again; a served worker has `liveness` heartbeats.
            loading = w.worker_state in WORKER_LOADING
            limit = max(beats, self.settings.boot_timeout) if loading else beats
            if now - w.last_heartbeat > limit:
                why = (f"no heartbeat for {now - w.last_heartbeat:.1f} s while loading "
                       f"(boot_timeout {self.settings.boot_timeout:g} s)") if loading else \
                    f"missed {self.liveness} heartbeats (none for {now - w.last_heartbeat:.1f} s)"
                self.apply(w, policy.Unresponsive(why))

    # -- worker traffic -----------------------------------------------------------------------

    def on_hello(self, identity: bytes, name: str, pid: int, hello: dict, body: Any) -> WorkerProcess | None:
        """The worker's hello, or None for a peer that is not the process we spawned."""
        w = self.workers.get(name)
        if w is None or w.pid != pid or identity != f"{name}:{pid}".encode():
            return None
        w.identity = identity
        w.hello = hello
        w.last_heartbeat = self.clock.monotonic()
        if isinstance(body, dict):
            w.status = body
        self.by_identity[identity] = name
        self.record("hello", name, f"pid {pid}, ops {', '.join(hello.get('ops') or [])}")
        self.apply(w, policy.Hello())
        if w.can_serve():
            self.on_ready(w)
        return w

    def on_heartbeat(self, w: WorkerProcess, body: Any) -> None:
        w.last_heartbeat = self.clock.monotonic()
        if isinstance(body, dict):
            was = w.can_serve()
            self._job_progress(w, w.status, body)
            w.status = body
            if not was and w.can_serve():
                self.on_ready(w)

    def _job_progress(self, w: WorkerProcess, old: dict, new: dict) -> None:
        """A job event when a trainer's or evaluator's heartbeat shows its job moved on."""
        job = new.get("job")
        if not job and old.get("job"):
            self.record("job_idle", w.name, f"{old['job']} no longer running")
        if not job:
            return
        done = new.get("step", new.get("done"))
        if job != old.get("job") or done != old.get("step", old.get("done")):
            total = new.get("total_steps", new.get("total"))
            loss = f", loss {new['loss']:.4f}" if isinstance(new.get("loss"), (int, float)) else ""
            self.record("job_progress", w.name, f"{job} {done}/{total}{loss}")

    def by_peer(self, identity: bytes) -> WorkerProcess | None:
        name = self.by_identity.get(identity)
        return self.workers[name] if name else None

    # -- questions the router asks ------------------------------------------------------------

    def gone_for_good(self, w: WorkerProcess) -> bool:
        """Fatal or stopped: waiting for it cannot help."""
        return w.ps.state in (FATAL, STOPPED)

    def loading(self, w: WorkerProcess) -> bool:
        return w.worker_state in WORKER_LOADING
