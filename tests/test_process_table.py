"""The process table with a fake spawner and a fake clock (fast tier): every timer — start_secs,
liveness, SIGTERM→SIGKILL, backoff — is driven by the test, no process is started."""

from __future__ import annotations

import signal

from fakes import FakeClock, FakeSpawner

from kiln.supervisor.core import policy
from kiln.supervisor.core.process_table import ProcessTable

SETTINGS = policy.Settings(start_secs=1.0, max_restarts=3, restart_window=60.0, backoff_initial=0.5,
                           backoff_max=8.0, boot_timeout=10.0, stable_secs=10.0)


class Rig:
    def __init__(self, obeys_sigterm: bool = True):
        self.clock, self.spawner = FakeClock(), FakeSpawner(obeys_sigterm)
        self.events, self.shutdowns, self.exits, self.ready = [], [], [], []
        self.table = ProcessTable({"w": {"kind": "test"}}, SETTINGS, self.spawner, self.clock,
                                  heartbeat_interval=1.0, liveness=3, graceful_timeout=5.0,
                                  record=lambda e, w, d: self.events.append((e, w, d)),
                                  send_shutdown=lambda w: self.shutdowns.append(w.name),
                                  on_exit=lambda w, how: self.exits.append((w.name, how)),
                                  on_ready=lambda w: self.ready.append(w.name))
        self.w = self.table["w"]

    def tick(self, dt: float = 0.0):
        self.clock.advance(dt)
        self.table.tick()

    def hello(self, state: str = "ready"):
        pid = self.w.pid
        return self.table.on_hello(f"w:{pid}".encode(), "w", pid, {"kind": "test", "ops": []}, {"state": state})

    def start_running(self):
        self.table.apply(self.w, policy.Start(manual=False))
        self.hello()
        self.tick(1.0)
        assert self.w.ps.state == "running"


def test_start_spawns_and_hello_plus_start_secs_makes_it_running():
    r = Rig()
    r.table.apply(r.w, policy.Start(manual=False))
    assert len(r.spawner.spawned) == 1 and r.w.ps.state == "starting"
    assert r.hello() is r.w and r.ready == ["w"]          # ready to serve before start_secs ends
    r.tick(0.5)
    assert r.w.ps.state == "starting"
    r.tick(0.6)
    assert r.w.ps.state == "running"


def test_a_loading_worker_has_boot_timeout_to_speak_and_a_served_one_has_liveness():
    """Parsing a model holds the GIL (tokenizer builders): a worker that says it is loading may
    miss heartbeats until boot_timeout; once ready, three missed heartbeats kill it."""
    r = Rig()
    r.table.apply(r.w, policy.Start(manual=False))
    r.hello(state="loading")
    first = r.spawner.last("w")
    r.tick(SETTINGS.boot_timeout - 1)
    assert signal.SIGKILL not in first.signals and r.w.ps.state == "running"
    r.tick(2.0)
    assert signal.SIGKILL in first.signals
    assert "while loading (boot_timeout" in r.w.ps.reason
    r.tick(0.0)
    r.tick(SETTINGS.backoff_initial)
    second = r.spawner.last("w")
    r.hello(state="loading")
    r.tick(5.0)
    assert signal.SIGKILL not in second.signals
    r.table.on_heartbeat(r.w, {"state": "ready"})
    r.tick(3.1)
    assert signal.SIGKILL in second.signals and "missed 3 heartbeats" in r.w.ps.reason


def test_a_hello_from_another_pid_is_refused():
    r = Rig()
    r.table.apply(r.w, policy.Start(manual=False))
    assert r.table.on_hello(b"w:1", "w", 1, {}, {}) is None
    assert r.w.identity is None


def test_missed_heartbeats_kill_and_a_served_worker_comes_back():
    r = Rig()
    r.start_running()
    first = r.spawner.last("w")
    r.table.on_heartbeat(r.w, {"state": "ready"})
    r.tick(2.9)
    assert signal.SIGKILL not in first.signals
    r.tick(0.2)                                          # 3 heartbeats missed
    assert signal.SIGKILL in first.signals
    r.tick(0.0)                                          # reaped
    assert r.exits and r.w.ps.state == "backoff" and r.w.ps.last_exit["signal"] == signal.SIGKILL
    r.tick(SETTINGS.backoff_initial)
    assert len(r.spawner.spawned) == 2 and r.w.ps.state == "starting"


def test_heartbeats_keep_it_alive_and_their_state_makes_it_ready():
    r = Rig()
    r.table.apply(r.w, policy.Start(manual=False))
    r.hello(state="loading")
    assert r.ready == [] and not r.w.can_serve()
    for _ in range(10):
        r.tick(1.0)
        r.table.on_heartbeat(r.w, {"state": "loading"})
    assert r.w.ps.state == "running" and not r.w.can_serve()
    r.table.on_heartbeat(r.w, {"state": "ready"})
    assert r.ready == ["w"] and r.w.can_serve()
    r.table.on_heartbeat(r.w, {"state": "loading", "model": "m"})
    r.table.apply(r.w, policy.Stop())
    r.tick(0.0)
    assert r.w.ps.state == "stopped"
    d = r.w.describe(r.clock.time())          # no process: no state of its own, its last stats kept
    assert d["worker_state"] is None and d["stats"] == {"model": "m"}


def test_stop_sends_shutdown_then_sigterm_and_sigkill_after_graceful_timeout():
    r = Rig(obeys_sigterm=False)
    r.start_running()
    p = r.spawner.last("w")
    r.table.apply(r.w, policy.Stop())
    assert r.shutdowns == ["w"] and signal.SIGTERM in p.signals and r.w.ps.state == "stopping"
    r.tick(4.9)
    assert signal.SIGKILL not in p.signals
    r.tick(0.2)
    assert signal.SIGKILL in p.signals
    r.tick(0.0)
    assert r.w.ps.state == "stopped" and r.w.pid is None


def test_exit_code_3_is_fatal_with_the_workers_reason():
    r = Rig()
    r.table.apply(r.w, policy.Start(manual=False))
    r.w.boot_reason = "model file /x.gguf: no such file"
    r.spawner.last("w").exit(3)
    r.tick(0.1)
    assert r.w.ps.state == "fatal" and r.w.ps.reason == "model file /x.gguf: no such file"
    r.tick(100)
    assert len(r.spawner.spawned) == 1


def test_a_spawn_that_fails_is_fatal_with_the_os_error():
    r = Rig()
    r.spawner.fail_next = "No such file or directory: 'python'"
    r.table.apply(r.w, policy.Start(manual=False))
    assert r.w.ps.state == "fatal" and "No such file" in r.w.ps.reason


def test_killed_every_eight_seconds_for_ten_minutes_it_always_comes_back():
    r = Rig()
    r.start_running()
    for _ in range(75):
        r.tick(7.0)
        r.spawner.last("w").send_signal(signal.SIGKILL)
        r.tick(0.0)
        assert r.w.ps.state == "backoff"
        r.tick(SETTINGS.backoff_initial)
        r.hello()
        r.tick(1.0)
        assert r.w.ps.state == "running"
    assert len(r.spawner.spawned) == 76 and r.w.ps.restarts == 75


def test_psutil_is_sampled_by_the_tick_not_by_describe():
    r = Rig()
    r.start_running()
    d = r.w.describe(r.clock.time())
    assert d["state"] == "running" and d["pid"] == r.w.pid and "rss_bytes" in d


def test_a_jobs_progress_in_heartbeats_becomes_events():
    r = Rig()
    r.start_running()
    for step in (1, 1, 2):
        r.table.on_heartbeat(r.w, {"state": "busy", "job": "train-1", "step": step, "total_steps": 16, "loss": 1.5})
    r.table.on_heartbeat(r.w, {"state": "ready", "job": None})
    progress = [d for e, w, d in r.events if e == "job_progress"]
    assert progress == ["train-1 1/16, loss 1.5000", "train-1 2/16, loss 1.5000"]
    assert ("job_idle", "w", "train-1 no longer running") in r.events
