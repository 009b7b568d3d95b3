"""When to start, restart, give up on, or stop a worker — as a pure function.

`step(state, event, now, settings) -> (state, actions)` decides; the process table carries the
actions out (spawn, terminate, kill) and feeds back what happened (spawned, hello, exited, …).
Nothing here reads a clock or touches a process, so the whole state machine is tested with an
injected clock (tests/test_policy.py), as supervisord tests its own.

States (supervisord's): stopped → starting → running → (backoff → starting)* → fatal, and
stopping. A start succeeds when the worker says hello and stays up `start_secs`.

The restart rule — a worker that has served is never given up on:
- A crash of a worker that reached `running` restarts it: at once when it had run `stable_secs`
  or longer, after `backoff_initial` when it had not (so a worker that dies on every request
  does not spin). It never counts toward `fatal`, and it resets the failed-start streak.
- A crash *before* `running` is a failed start (circus's flapping: a crash within moments of its
  start). Failed starts back off 1, 2, 4 … × `backoff_initial` up to `backoff_max`; the
  `max_restarts`-th failed start in a row within `restart_window` is `fatal`.
- Exit code 3 (a boot error: bad model path, corrupt file) is `fatal` at once, with the
  worker's own reason. `fatal` lasts until a manual start or restart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.protocol.vocab import ALIVE, BACKOFF, FATAL, RUNNING, STARTING, STOPPED, STOPPING

EXIT_BOOT_ERROR = 3


@dataclass(frozen=True)
class Settings:
    start_secs: float = 1.0
    max_restarts: int = 5
    restart_window: float = 60.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    boot_timeout: float = 120.0
    stable_secs: float = 10.0


@dataclass(frozen=True)
class ProcState:
    state: str = STOPPED
    restarts: int = 0                           # automatic and manual restarts, shown to users
    recent: tuple[float, ...] = ()              # times of the failed starts in the current streak
    retry_at: float | None = None               # end of the backoff delay
    spawned_at: float | None = None
    hello_at: float | None = None
    running_at: float | None = None             # when this process became `running`
    restart_after_stop: bool = False
    last_exit: dict | None = None               # {code, signal, reason, ran_s}
    reason: str | None = None                   # why it is fatal / stopped / killed / backing off


# events
@dataclass(frozen=True)
class Start:
    manual: bool = True


@dataclass(frozen=True)
class Restart:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Spawned:
    pass


@dataclass(frozen=True)
class SpawnFailed:
    reason: str


@dataclass(frozen=True)
class Hello:
    pass


@dataclass(frozen=True)
class Exited:
    code: int | None
    signal: int | None
    reason: str | None = None


@dataclass(frozen=True)
class Unresponsive:
    reason: str


@dataclass(frozen=True)
class Tick:
    pass


# actions: ("spawn",), ("terminate",) graceful, ("kill", reason) at once
Action = tuple


def _after_crash(s: ProcState, now: float, cfg: Settings) -> tuple[ProcState, list[Action]]:
    served = s.running_at is not None
    ran = now - s.spawned_at if s.spawned_at is not None else 0.0
    s = replace(s, spawned_at=None, hello_at=None, running_at=None, restarts=s.restarts + 1)
    if served:
        delay = 0.0 if ran >= cfg.stable_secs else cfg.backoff_initial
        s = replace(s, recent=())
        why = f"had served {ran:.1f} s; " + ("restarting now" if delay <= 0 else f"restarting in {delay:g} s")
    else:
        recent = tuple(t for t in s.recent if now - t < cfg.restart_window) + (now,)
        if len(recent) >= cfg.max_restarts:
            return replace(s, state=FATAL, recent=recent, retry_at=None,
                           reason=f"failed to start {len(recent)} times in a row within {cfg.restart_window:g} s "
                                  f"(max_restarts {cfg.max_restarts}); `kiln restart` to try again"), []
        delay = min(cfg.backoff_initial * (2 ** (len(recent) - 1)), cfg.backoff_max)
        s = replace(s, recent=recent)
        why = f"failed start {len(recent)} of {cfg.max_restarts}; restarting in {delay:g} s"
    if delay <= 0:
        return replace(s, state=STARTING, retry_at=None, spawned_at=now, reason=None), [("spawn",)]
    return replace(s, state=BACKOFF, retry_at=now + delay, reason=why), []


def step(s: ProcState, event, now: float, cfg: Settings) -> tuple[ProcState, list[Action]]:
    match event:
        case Start(manual=manual):
            if s.state in ALIVE:
                return s, []
            fresh = replace(s, state=STARTING, retry_at=None, spawned_at=now, hello_at=None, running_at=None,
                            reason=None, restart_after_stop=False)
            if manual:
                fresh = replace(fresh, recent=())
            return fresh, [("spawn",)]
        case Restart():
            if s.state in (STARTING, RUNNING):
                return replace(s, state=STOPPING, restart_after_stop=True,
                               restarts=s.restarts + 1), [("terminate",)]
            if s.state == STOPPING:
                return replace(s, restart_after_stop=True), []
            return step(replace(s, restarts=s.restarts + 1), Start(manual=True), now, cfg)
        case Stop():
            if s.state in (STARTING, RUNNING):
                return replace(s, state=STOPPING, restart_after_stop=False, reason="stopped by request"), \
                    [("terminate",)]
            if s.state == STOPPING:
                return replace(s, restart_after_stop=False), []
            return replace(s, state=STOPPED, retry_at=None, reason="stopped by request"), []
        case Spawned():
            return replace(s, spawned_at=now), []
        case SpawnFailed(reason=reason):
            return replace(s, state=FATAL, reason=f"could not start: {reason}",
                           last_exit={"code": None, "signal": None, "reason": reason}), []
        case Hello():
            if s.state == STARTING:
                return replace(s, hello_at=now), []
            return s, []
        case Exited(code=code, signal=sig, reason=reason):
            ran = round(now - s.spawned_at, 3) if s.spawned_at is not None else None
            s = replace(s, last_exit={"code": code, "signal": sig, "reason": reason, "ran_s": ran})
            if s.state == STOPPING:
                s = replace(s, spawned_at=None, hello_at=None, running_at=None)
                if s.restart_after_stop:
                    return replace(s, state=STARTING, restart_after_stop=False, spawned_at=now,
                                   recent=(), reason=None), [("spawn",)]
                return replace(s, state=STOPPED), []
            if s.state not in ALIVE:
                return s, []
            if code == EXIT_BOOT_ERROR:
                return replace(s, state=FATAL, retry_at=None, spawned_at=None, hello_at=None, running_at=None,
                               reason=reason or "boot error (exit code 3)"), []
            return _after_crash(s, now, cfg)
        case Unresponsive(reason=reason):
            if s.state in ALIVE:
                return replace(s, reason=reason), [("kill", reason)]
            return s, []
        case Tick():
            if s.state == STARTING:
                if s.hello_at is not None and now - s.hello_at >= cfg.start_secs:
                    return replace(s, state=RUNNING, running_at=now, recent=(), reason=None), []
                if s.hello_at is None and s.spawned_at is not None and now - s.spawned_at > cfg.boot_timeout:
                    why = f"no hello within boot_timeout {cfg.boot_timeout:g} s"
                    return replace(s, reason=why), [("kill", why)]
            if s.state == BACKOFF and s.retry_at is not None and now >= s.retry_at:
                return replace(s, state=STARTING, retry_at=None, spawned_at=now), [("spawn",)]
            return s, []
    raise TypeError(f"unknown event {event!r}")
