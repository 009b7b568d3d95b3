"""The process table: every worker's process, its lifecycle state, and the timers that watch it.

It carries out the restart policy's decisions (spawn, terminate, kill) through a *spawner* and
feeds back what happened (spawned, hello, exited, missed heartbeats). Every timer — heartbeat
liveness, SIGTERM→SIGKILL, backoff, start_secs — runs on the injected clock's monotonic time, so
the fast tests drive the whole table with a fake spawner and a fake clock, as supervisord's do.

Liveness tells a busy machine from a hung worker:
- Silence is counted on the table's *attention* clock, which advances by at most `max_tick_gap`
  per tick: when the supervisor's own loop woke late (not scheduled, or blocked), that gap is its
  lateness, not the workers' silence.
- A silent worker whose CPU time advanced over the last `liveness` intervals (sampled with psutil
  every interval) is working: it has `progress_timeout` before it is judged hung (a loop that
  never yields still is).
- A stopped process (SIGSTOP) or one silent with its CPU idle (a deadlock) is killed after
  `liveness` heartbeats, as before (one that computed until it deadlocked, once that window
  holds no more work).
"""

from __future__ import annotations

import os
import signal
from collections import deque
from typing import Any, Callable

import psutil

from kiln.protocol.vocab import ALIVE, FATAL, RUNNING, STARTING, STOPPED, WORKER_LOADING

from . import policy
from .processes import sample
from .worker_process import SystemClock, WorkerProcess  # noqa: F401  (the table's rows, named from here too)


MAX_STOP_GRACE = 120.0          # the longest a worker may ask to wind down
# CPU seconds per second, over the last `liveness` heartbeat intervals, above which a silent worker
# counts as working: a hung one's idle threads (poll wake-ups) use well under 0.1 %, a computing
# one ~20 % under load 9 on 2 cores — and none at all in some 0.2 s stretches, hence the window
PROGRESS_SHARE = 0.02
MIN_PROGRESS_S = 0.02       # two of /proc's 10 ms CPU-time ticks


class ProcessTable:
    """Workers by name. `tick()` is called by the daemon's loop; the hooks tell the rest of the
    supervisor what happened: `record(event, worker, detail)`, `send_shutdown(worker)`,
    `on_exit(worker, how)` (the router fails or retries that worker's requests)."""

    def __init__(self, workers: dict[str, dict], settings: policy.Settings, spawner, clock=SystemClock,
                 heartbeat_interval: float = 1.0, liveness: int = 3, graceful_timeout: float = 5.0,
                 record: Callable[[str, str | None, str], None] = lambda *a: None,
                 send_shutdown: Callable[[WorkerProcess], None] = lambda w: None,
                 on_exit: Callable[[WorkerProcess, str], None] = lambda w, how: None,
                 on_ready: Callable[[WorkerProcess], None] = lambda w: None,
                 progress_timeout: float = 30.0, max_tick_gap: float | None = None,
                 probe: Callable[[int], tuple[float, bool] | None] | None = None):
        """`max_tick_gap`: the longest the caller's loop sleeps between ticks when it runs on time
        (None: every gap counts, as in the fast tests). `probe(pid)`: (CPU seconds, stopped) of a
        worker process, or None when unknown; psutil's by default."""
        self.workers = {n: WorkerProcess(n, spec) for n, spec in workers.items()}
        self.settings, self.spawner, self.clock = settings, spawner, clock
        self.heartbeat_interval, self.liveness, self.graceful_timeout = heartbeat_interval, liveness, graceful_timeout
        self.record, self.send_shutdown, self.on_exit, self.on_ready = record, send_shutdown, on_exit, on_ready
        self.progress_timeout, self.max_tick_gap = progress_timeout, max_tick_gap
        self.probe = probe or self._psutil_probe
        self.by_identity: dict[bytes, str] = {}
        self._psutil: dict = {}
        self._procs: dict[int, Any] = {}             # psutil handles of the progress probe, by pid
        self._sampled_at = -1e9
        self.attended = 0.0                          # seconds the loop was there to hear workers
        self._ticked_at = clock.monotonic()

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
        w.cpu_samples, w.sampled_at = deque(), None
        w.advancing = w.stopped = w.spared = False
        self._heard(w)
        w.started_wall = self.clock.time()
        node = getattr(w.proc, "node", None)
        self.record("spawned", w.name, f"on node {node.label}" if node else f"pid {w.pid}")
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
        self._attend(now)
        self._reap(now)
        self._sample_progress(now)
        self._check_liveness(now)
        for w in self.workers.values():
            self.apply(w, policy.Tick())
        if now - self._sampled_at >= 1.0:          # psutil once a second, never per request
            self._sampled_at = now
            for w in self.workers.values():
                if w.pid and getattr(w.proc, "local", True):     # a pid of another machine: its own stats
                    w.rss, w.cpu = sample(w.pid, self._psutil.setdefault(w.name, {}))

    def _attend(self, now: float) -> None:
        """Advance the attention clock by the time since the last tick, but by no more than the
        loop's own period: a loop that woke late does not blame the workers for its lateness."""
        gap = now - self._ticked_at
        credit = self._credit(gap)
        self._ticked_at, self.attended = now, self.attended + credit
        if gap - credit >= self.heartbeat_interval:
            self.record("supervisor_late", None,
                        f"the supervisor's loop ran {gap:.1f} s between two checks (busy machine or a blocking "
                        f"call); workers' silence over that time is not held against them")

    def _credit(self, gap: float) -> float:
        return max(0.0, gap if self.max_tick_gap is None else min(gap, self.max_tick_gap))

    def _heard(self, w: WorkerProcess) -> None:
        w.last_heartbeat = now = self.clock.monotonic()
        w.heard_at = self.attended + self._credit(now - self._ticked_at)
        w.spared = False

    def _sample_progress(self, now: float) -> None:
        """CPU time and stopped state of each live worker, every heartbeat interval (at most once a
        second): a /proc read each, off no request's path. `advancing` judges the CPU time used
        over the last `liveness` intervals: one short interval can hold no slice of a busy core."""
        every = min(1.0, self.heartbeat_interval)
        window = self.liveness * self.heartbeat_interval
        for w in self.workers.values():
            if not w.pid or (w.sampled_at is not None and now - w.sampled_at < every):
                continue
            if getattr(w.proc, "token", None) is None:
                got = self.probe(w.pid)
            else:                  # a cluster node's process: readable here only on this machine
                got = self._psutil_probe(w.pid, adopted=True) if w.proc.local else None
            w.sampled_at = now
            if got is None:
                w.cpu_samples.clear()
                w.advancing = w.stopped = False
                continue
            cpu, w.stopped = got
            samples = w.cpu_samples
            samples.append((now, cpu))
            while len(samples) > 2 and samples[1][0] <= now - window:
                samples.popleft()                 # the oldest kept one starts the window
            # and starts an interval after the last heartbeat: what the worker did as it fell
            # silent (finishing the very call that then blocks it) is not progress in silence
            while len(samples) > 1 and samples[0][0] < w.last_heartbeat + every:
                samples.popleft()
            (_, cpu0), span = samples[0], now - samples[0][0]
            # /proc counts CPU time in 10 ms ticks: one tick is no evidence of a computation
            w.advancing = span > 0 and cpu - cpu0 >= max(PROGRESS_SHARE * span, MIN_PROGRESS_S)
        live = {w.pid for w in self.workers.values() if w.pid}
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]

    def _psutil_probe(self, pid: int, adopted: bool = False) -> tuple[float, bool] | None:
        """(user + system CPU seconds, stopped) of a process this supervisor started (`adopted`:
        one a Ray actor started for it on this machine); None for any other pid (a test's fake
        one), or when it is gone."""
        try:
            p = self._procs.get(pid)
            if p is None:
                p = self._procs[pid] = psutil.Process(pid)
            with p.oneshot():
                if not adopted and p.ppid() != os.getpid():
                    return None
                t = p.cpu_times()
                return t.user + t.system, p.status() == psutil.STATUS_STOPPED
        except psutil.Error:
            self._procs.pop(pid, None)
            return None

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
            lost = getattr(w.proc, "exit_reason", None)   # a cluster node's: lost, or no process started
            w.proc, w.kill_at = None, None
            if w.identity:
                self.by_identity.pop(w.identity, None)
            w.identity = None
            reason = w.boot_reason or lost
            if code == policy.EXIT_BOOT_ERROR and not reason:
                last_line = getattr(self.spawner, "last_log_line", None)
                reason = last_line(w.name) if last_line else None
            how = f"code {code}" if sig is None else f"signal {sig} ({signal.Signals(sig).name})"
            self.record("exited", w.name, how + (f": {reason}" if reason else ""))
            self.on_exit(w, how + (f": {lost}" if lost else ""))
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
            silent, wall = self.attended - w.heard_at, now - w.last_heartbeat
            if w.stopped and wall > limit:
                # stopped makes no progress whoever is late: wall time is the measure
                why = f"missed {self.liveness} heartbeats (none for {wall:.1f} s; the process is stopped)"
            elif silent <= limit:
                continue
            elif w.advancing and silent <= max(limit, self.progress_timeout):
                if not w.spared:
                    w.spared = True
                    self.record("busy_silent", w.name,
                                f"no heartbeat for {silent:.1f} s, but its CPU time advances: it has until "
                                f"progress_timeout ({self.progress_timeout:g} s) to speak")
                continue
            elif w.advancing:
                why = (f"no heartbeat for {silent:.1f} s while its CPU time kept advancing "
                       f"(progress_timeout {self.progress_timeout:g} s): it computes without ever answering")
            elif loading:
                why = f"no heartbeat for {silent:.1f} s while loading (boot_timeout {self.settings.boot_timeout:g} s)"
            else:
                why = f"missed {self.liveness} heartbeats (none for {silent:.1f} s)"
            self.apply(w, policy.Unresponsive(why))

    # -- worker traffic -----------------------------------------------------------------------

    def on_hello(self, identity: bytes, name: str, pid: int, hello: dict, body: Any) -> WorkerProcess | None:
        """The worker's hello, or None for a peer that is not the process we spawned."""
        w = self.workers.get(name)
        if w is None or w.proc is None or identity != f"{name}:{pid}".encode():
            return None
        token = getattr(w.proc, "token", None)      # a process on a cluster node: its pid is its node's
        if token is None and w.pid != pid or token is not None and hello.get("token") != token:
            return None
        if token is not None:
            w.proc.pid = pid
        w.identity = identity
        w.hello = hello
        self._heard(w)
        if isinstance(body, dict):
            w.status = body
        self.by_identity[identity] = name
        self.record("hello", name, f"pid {pid}, ops {', '.join(hello.get('ops') or [])}")
        self.apply(w, policy.Hello())
        if w.can_serve():
            self.on_ready(w)
        return w

    def on_heartbeat(self, w: WorkerProcess, body: Any) -> None:
        self._heard(w)
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
