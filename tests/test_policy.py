"""The restart policy as a pure state machine, driven by an injected clock."""

from kiln.supervisor.policy import (Exited, Hello, ProcState, Restart, Settings, Spawned, Start, Stop,
                                    Tick, Unresponsive, step)

CFG = Settings(start_secs=1.0, max_restarts=3, restart_window=60.0, backoff_initial=1.0,
               backoff_max=4.0, boot_timeout=10.0)


class Clock:
    def __init__(self):
        self.now = 1000.0
        self.state = ProcState()
        self.actions = []

    def __call__(self, event, advance: float = 0.0):
        self.now += advance
        self.state, self.actions = step(self.state, event, self.now, CFG)
        return self.actions


def started():
    c = Clock()
    assert c(Start()) == [("spawn",)]
    c(Spawned())
    c(Hello(), 0.1)
    c(Tick(), 1.0)
    assert c.state.state == "running"
    return c


def test_a_worker_is_running_only_after_hello_and_start_secs():
    c = Clock()
    c(Start()); c(Spawned()); c(Tick(), 5.0)
    assert c.state.state == "starting"
    c(Hello()); c(Tick(), 0.5)
    assert c.state.state == "starting"
    c(Tick(), 0.6)
    assert c.state.state == "running"


def test_a_crash_backs_off_exponentially_then_restarts():
    c = started()
    delays = []
    for _ in range(3):
        assert c(Exited(None, 9)) == []
        assert c.state.state == "backoff"
        delays.append(c.state.retry_at - c.now)
        assert c(Tick(), delays[-1] - 0.01) == []
        assert c(Tick(), 0.02) == [("spawn",)]
        c(Spawned()); c(Hello()); c(Tick(), 1.0)
    assert delays == [1.0, 2.0, 4.0]
    assert c.state.restarts == 3
    assert c.state.last_exit == {"code": None, "signal": 9, "reason": None}


def test_backoff_is_capped():
    cfg = Settings(max_restarts=10, backoff_initial=1.0, backoff_max=4.0)
    s, now = ProcState(state="running"), 0.0
    delays = []
    for _ in range(6):
        s, _ = step(s, Exited(1, None), now, cfg)
        delays.append(s.retry_at - now)
        now = s.retry_at
        s, _ = step(s, Tick(), now, cfg)
    assert delays == [1, 2, 4, 4, 4, 4]


def test_too_many_restarts_in_the_window_is_fatal_until_a_manual_restart():
    c = started()
    for _ in range(3):
        c(Exited(1, None))
        c(Tick(), 10)
        c(Spawned())
    c(Exited(1, None))
    assert c.state.state == "fatal"
    assert "max_restarts 3" in c.state.reason
    assert c(Tick(), 100) == []
    assert c(Restart()) == [("spawn",)]
    assert c.state.state == "starting" and c.state.recent == ()


def test_restarts_outside_the_window_do_not_count():
    c = started()
    for _ in range(10):
        c(Exited(1, None))
        c(Tick(), 61)
        c(Spawned())
        assert c.state.state == "starting"


def test_exit_code_3_is_fatal_at_once_with_the_workers_reason():
    c = Clock()
    c(Start()); c(Spawned())
    assert c(Exited(3, None, "model file /x.gguf: no such file")) == []
    assert c.state.state == "fatal"
    assert c.state.reason == "model file /x.gguf: no such file"


def test_missed_heartbeats_kill_and_the_exit_restarts():
    c = started()
    assert c(Unresponsive("missed 3 heartbeats")) == [("kill", "missed 3 heartbeats")]
    c(Exited(None, 9))
    assert c.state.state == "backoff"


def test_no_hello_before_boot_timeout_is_killed():
    c = Clock()
    c(Start()); c(Spawned())
    assert c(Tick(), 11) == [("kill", "no hello within boot_timeout 10 s")]


def test_stop_terminates_and_ends_stopped_without_restart():
    c = started()
    assert c(Stop()) == [("terminate",)]
    assert c.state.state == "stopping"
    c(Exited(0, None))
    assert c.state.state == "stopped"
    assert c(Tick(), 100) == []


def test_restart_of_a_running_worker_stops_then_starts():
    c = started()
    assert c(Restart()) == [("terminate",)]
    assert c(Exited(None, 15)) == [("spawn",)]
    assert c.state.state == "starting" and c.state.restarts == 1


def test_stop_during_backoff_cancels_the_retry():
    c = started()
    c(Exited(1, None))
    c(Stop())
    assert c.state.state == "stopped"
    assert c(Tick(), 100) == []
