"""The restart policy as a pure state machine, driven by an injected clock."""

from kiln.supervisor.core.policy import (Exited, Hello, ProcState, Restart, Settings, Spawned, Start, Stop,
                                    Tick, Unresponsive, step)

CFG = Settings(start_secs=1.0, max_restarts=3, restart_window=60.0, backoff_initial=1.0,
               backoff_max=4.0, boot_timeout=10.0, stable_secs=10.0)


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


def test_failed_starts_back_off_exponentially_then_restart():
    c = Clock()
    c(Start()); c(Spawned())
    delays = []
    for _ in range(2):
        assert c(Exited(None, 9), 0.2) == []                # died before it was running
        assert c.state.state == "backoff"
        delays.append(c.state.retry_at - c.now)
        assert c(Tick(), delays[-1] - 0.01) == []
        assert c(Tick(), 0.02) == [("spawn",)]
        c(Spawned())
    assert delays == [1.0, 2.0]
    assert c.state.restarts == 2
    assert c.state.last_exit["signal"] == 9 and c.state.last_exit["ran_s"] == 0.2


def test_failed_start_backoff_is_capped():
    cfg = Settings(max_restarts=10, backoff_initial=1.0, backoff_max=4.0)
    s, now = ProcState(state="starting", spawned_at=0.0), 0.0
    delays = []
    for _ in range(6):
        s, _ = step(s, Exited(1, None), now, cfg)
        delays.append(s.retry_at - now)
        now = s.retry_at
        s, _ = step(s, Tick(), now, cfg)
    assert delays == [1, 2, 4, 4, 4, 4]


def test_max_restarts_failed_starts_in_a_row_is_fatal_until_a_manual_restart():
    c = Clock()
    c(Start()); c(Spawned())
    for _ in range(2):
        c(Exited(1, None), 0.1)
        c(Tick(), 10)
        c(Spawned())
    c(Exited(1, None), 0.1)
    assert c.state.state == "fatal"
    assert "failed to start 3 times" in c.state.reason and "max_restarts 3" in c.state.reason
    assert c(Tick(), 100) == []
    assert c(Restart()) == [("spawn",)]
    assert c.state.state == "starting" and c.state.recent == ()


def test_failed_starts_outside_the_window_do_not_count():
    c = Clock()
    c(Start()); c(Spawned())
    for _ in range(10):
        c(Exited(1, None))
        c(Tick(), 61)
        c(Spawned())
        assert c.state.state == "starting"


def test_a_worker_that_has_served_is_never_given_up_on():
    """Killed every 8 s (less than stable_secs) for an hour: never fatal, never a growing delay."""
    c = started()
    for _ in range(450):
        c(Tick(), 7.0)
        assert c(Exited(None, 9)) == []
        assert c.state.state == "backoff" and c.state.retry_at - c.now == CFG.backoff_initial
        assert c(Tick(), CFG.backoff_initial) == [("spawn",)]
        c(Spawned()); c(Hello(), 0.1); c(Tick(), 1.0)
        assert c.state.state == "running"
    assert c.state.restarts == 450


def test_a_crash_after_stable_secs_restarts_at_once():
    c = started()
    c(Tick(), CFG.stable_secs)
    assert c(Exited(None, 9)) == [("spawn",)]
    assert c.state.state == "starting" and c.state.retry_at is None


def test_a_served_worker_that_then_fails_to_start_counts_from_zero():
    c = started()
    c(Tick(), 20)
    c(Exited(None, 9))                                    # served: restarted at once
    c(Spawned())
    for i in range(CFG.max_restarts - 1):
        c(Exited(1, None), 0.1)                           # then its starts fail
        assert c.state.state == "backoff"
        c(Tick(), 5)
        c(Spawned())
    c(Exited(1, None), 0.1)
    assert c.state.state == "fatal"


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
    assert c.state.state == "backoff"           # it had served for 1 s: a short pause, then a restart


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
