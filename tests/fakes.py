"""Fakes for the fast tier: a clock the test moves, and a spawner whose processes exit when the
test (or a signal) says so — supervisord's fake-process tests, for the process table and router."""

from __future__ import annotations

import signal


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return 1.7e9 + self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeProc:
    def __init__(self, pid: int, obeys_sigterm: bool = True):
        self.pid, self.obeys_sigterm = pid, obeys_sigterm
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if self.returncode is None and (sig == signal.SIGKILL or (sig == signal.SIGTERM and self.obeys_sigterm)):
            self.returncode = -sig

    def exit(self, code: int) -> None:
        self.returncode = code


class FakeSpawner:
    def __init__(self, obeys_sigterm: bool = True):
        self.next_pid = 100
        self.spawned: list[tuple[str, FakeProc]] = []
        self.obeys_sigterm = obeys_sigterm
        self.fail_next: str | None = None

    def spawn(self, name: str, spec: dict) -> FakeProc:
        if self.fail_next:
            why, self.fail_next = self.fail_next, None
            raise OSError(why)
        self.next_pid += 1
        p = FakeProc(self.next_pid, self.obeys_sigterm)
        self.spawned.append((name, p))
        return p

    def last(self, name: str) -> FakeProc:
        return [p for n, p in self.spawned if n == name][-1]
