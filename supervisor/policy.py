"""When to start, restart, give up on, or stop a worker — as a pure function.

`step(state, event, now, settings) -> (state, actions)` decides; the daemon carries the actions
out (spawn, terminate, kill) and feeds back what happened (spawned, hello, exited, …). Nothing
here reads a clock or touches a process, so the whole state machine is tested with an injected
clock (tests/test_policy.py), as supervisord tests its own.

States (supervisord's): stopped → starting → running → (backoff → starting)* → fatal, and
stopping. A start succeeds when the worker says hello and stays up `start_secs`. An exit with
code 3 (boot error: bad model path, corrupt file) is fatal at once, with the worker's reason.
More than `max_restarts` automatic restarts within `restart_window` is fatal too, until a manual
start or restart. Restart delays double from `backoff_initial` up to `backoff_max`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

EXIT_BOOT_ERROR = 3
ALIVE = ("starting", "running", "stopping")


@dataclass(frozen=True)
class Settings:
    start_secs: float = 1.0
    max_restarts: int = 5
    restart_window: float = 60.0
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    boot_timeout: float = 120.0


@dataclass(frozen=True)
class ProcState:
    state: str = "stopped"
    restarts: int = 0                           # automatic and manual restarts, shown to users
    recent: tuple[float, ...] = ()              # times of automatic restarts, for the window
    retry_at: float | None = None               # end of the backoff delay
    spawned_at: float | None = None
    hello_at: float | None = None
    restart_after_stop: bool = False
    last_exit: dict | None = None               # {code, signal, reason}
    reason: str | None = None                   # why it is fatal / stopped / killed


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


def _restart_or_fatal(s: ProcState, now: float, cfg: Settings) -> tuple[ProcState, list[Action]]:
    recent = tuple(t for t in s.recent if now - t < cfg.restart_window)
    if len(recent) >= cfg.max_restarts:
        return replace(s, state="fatal", recent=recent, retry_at=None,
                       reason=f"exited {len(recent) + 1} times within {cfg.restart_window:g} s "
                              f"(max_restarts {cfg.max_restarts}); `kiln restart` to try again"), []
    delay = min(cfg.backoff_initial * (2 ** len(recent)), cfg.backoff_max)
    s = replace(s, recent=recent + (now,), restarts=s.restarts + 1, spawned_at=None, hello_at=None)
    if delay <= 0:
        return replace(s, state="starting", retry_at=None, spawned_at=now), [("spawn",)]
    return replace(s, state="backoff", retry_at=now + delay), []


def step(s: ProcState, event, now: float, cfg: Settings) -> tuple[ProcState, list[Action]]:
    match event:
        case Start(manual=manual):
            if s.state in ALIVE:
                return s, []
            fresh = replace(s, state="starting", retry_at=None, spawned_at=now, hello_at=None,
                            reason=None, restart_after_stop=False)
            if manual:
                fresh = replace(fresh, recent=())
            return fresh, [("spawn",)]
        case Restart():
            if s.state in ("starting", "running"):
                return replace(s, state="stopping", restart_after_stop=True,
                               restarts=s.restarts + 1), [("terminate",)]
            if s.state == "stopping":
                return replace(s, restart_after_stop=True), []
            return step(replace(s, restarts=s.restarts + 1), Start(manual=True), now, cfg)
        case Stop():
            if s.state in ("starting", "running"):
                return replace(s, state="stopping", restart_after_stop=False, reason="stopped by request"), \
                    [("terminate",)]
            if s.state == "stopping":
                return replace(s, restart_after_stop=False), []
            return replace(s, state="stopped", retry_at=None, reason="stopped by request"), []
        case Spawned():
            return replace(s, spawned_at=now), []
        case SpawnFailed(reason=reason):
            return replace(s, state="fatal", reason=f"could not start: {reason}",
                           last_exit={"code": None, "signal": None, "reason": reason}), []
        case Hello():
            if s.state == "starting":
                return replace(s, hello_at=now), []
            return s, []
        case Exited(code=code, signal=sig, reason=reason):
            s = replace(s, last_exit={"code": code, "signal": sig, "reason": reason},
                        spawned_at=None, hello_at=None)
            if s.state == "stopping":
                if s.restart_after_stop:
                    return replace(s, state="starting", restart_after_stop=False, spawned_at=now,
                                   recent=(), reason=None), [("spawn",)]
                return replace(s, state="stopped"), []
            if s.state not in ALIVE:
                return s, []
            if code == EXIT_BOOT_ERROR:
                return replace(s, state="fatal", retry_at=None,
                               reason=reason or "boot error (exit code 3)"), []
            return _restart_or_fatal(s, now, cfg)
        case Unresponsive(reason=reason):
            if s.state in ALIVE:
                return replace(s, reason=reason), [("kill", reason)]
            return s, []
        case Tick():
            if s.state == "starting":
                if s.hello_at is not None and now - s.hello_at >= cfg.start_secs:
                    return replace(s, state="running", reason=None), []
                if s.hello_at is None and s.spawned_at is not None and now - s.spawned_at > cfg.boot_timeout:
                    why = f"no hello within boot_timeout {cfg.boot_timeout:g} s"
                    return replace(s, reason=why), [("kill", why)]
            if s.state == "backoff" and s.retry_at is not None and now >= s.retry_at:
                return replace(s, state="starting", retry_at=None, spawned_at=now), [("spawn",)]
            return s, []
    raise TypeError(f"unknown event {event!r}")
