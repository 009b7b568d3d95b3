"""Liveness rules of the process table (fast tier, fake clock and fake CPU probe): a late
supervisor loop does not blame workers, a silent worker whose CPU time advances gets
progress_timeout, a stopped or idle silent one is still killed after `liveness` heartbeats.
The same rules against a real daemon: tests/test_liveness.py."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from fakes import FakeClock, FakeSpawner

from kiln.native.gguf_file import read_gguf
from kiln.native.tokenizer import GIL_FREE_CHARS, GGUFTokenizer, TooManyTokens
from kiln.supervisor.core import policy
from kiln.supervisor.core.process_table import ProcessTable

SETTINGS = policy.Settings(start_secs=1.0, max_restarts=3, restart_window=60.0, backoff_initial=0.5,
                           backoff_max=8.0, boot_timeout=10.0, stable_secs=10.0)
LOOP = 0.1                     # the fake loop's period; the table is told it never sleeps longer than 0.25 s


class Rig:
    def __init__(self, progress_timeout: float = 20.0):
        self.clock, self.spawner = FakeClock(), FakeSpawner()
        self.events = []
        self.cpu: dict[int, list] = {}                 # pid -> [cpu seconds, stopped]
        self.table = ProcessTable({"w": {"kind": "test"}}, SETTINGS, self.spawner, self.clock,
                                  heartbeat_interval=1.0, liveness=3, graceful_timeout=5.0,
                                  record=lambda e, w, d: self.events.append((e, w, d)),
                                  progress_timeout=progress_timeout, max_tick_gap=0.25,
                                  probe=lambda pid: tuple(self.cpu[pid]) if pid in self.cpu else None)
        self.w = self.table["w"]
        self.table.apply(self.w, policy.Start(manual=False))
        self.proc = self.spawner.last("w")
        self.cpu[self.proc.pid] = [0.0, False]
        pid = self.w.pid
        self.table.on_hello(f"w:{pid}".encode(), "w", pid, {"kind": "test", "ops": []}, {"state": "ready"})
        self.run(1.5)
        assert self.w.ps.state == "running"

    def run(self, seconds: float, cpu_share: float = 0.0, beat: bool = False) -> None:
        """The loop ticking on time for `seconds`; the worker uses `cpu_share` of a core."""
        for _ in range(round(seconds / LOOP)):
            self.clock.advance(LOOP)
            self.cpu[self.proc.pid][0] += cpu_share * LOOP
            if beat:
                self.table.on_heartbeat(self.w, {"state": "ready"})
            self.table.tick()

    def stall(self, seconds: float) -> None:
        """The supervisor's loop not running (descheduled or blocked) for `seconds`."""
        self.clock.advance(seconds)
        self.table.tick()

    @property
    def killed(self) -> bool:
        return signal.SIGKILL in self.proc.signals

    @property
    def why(self) -> str:
        """The reason the worker was killed (its state moves on once it is reaped)."""
        return self.event("killed")[-1]

    def event(self, name: str) -> list[str]:
        return [d for e, w, d in self.events if e == name]


def test_a_late_loop_does_not_blame_a_worker_for_its_own_lateness():
    r = Rig()
    r.run(0.5, beat=True)
    r.stall(6.0)                                   # the worker's heartbeats wait in the socket meanwhile
    assert not r.killed and r.w.ps.state == "running"
    assert "ran 6.0 s between two checks" in r.event("supervisor_late")[0]
    r.table.on_heartbeat(r.w, {"state": "ready"})  # read once the loop runs again
    r.run(2.5)
    assert not r.killed


def test_a_late_loop_still_catches_a_silent_worker_on_the_time_it_was_there():
    r = Rig()
    r.table.on_heartbeat(r.w, {"state": "ready"})
    r.stall(6.0)
    r.run(2.5)                                     # 0.25 + 2.5 s heard of the silence: not yet 3 beats
    assert not r.killed
    r.run(0.5)
    assert r.killed and "missed 3 heartbeats" in r.why


def test_a_silent_worker_whose_cpu_advances_gets_progress_timeout_then_is_killed():
    r = Rig(progress_timeout=20.0)
    r.table.on_heartbeat(r.w, {"state": "ready"})
    r.run(15.0, cpu_share=0.3)                     # an op holding the GIL: busy, no heartbeats
    assert not r.killed
    assert len(r.event("busy_silent")) == 1 and "progress_timeout (20 s)" in r.event("busy_silent")[0]
    r.table.on_heartbeat(r.w, {"state": "ready"})  # it let go: the next silence starts afresh
    r.run(15.0, cpu_share=0.3)
    assert not r.killed and len(r.event("busy_silent")) == 2
    r.run(5.5, cpu_share=0.3)                      # a loop that never yields: a hang all the same
    assert r.killed
    assert "CPU time kept advancing (progress_timeout 20 s)" in r.why


def test_a_worker_scheduled_in_bursts_is_judged_on_its_cpu_over_the_liveness_window():
    """On a crowded machine a computing process gets no slice at all in some intervals."""
    r = Rig(progress_timeout=20.0)
    r.table.on_heartbeat(r.w, {"state": "ready"})
    for _ in range(6):
        r.run(1.0, cpu_share=0.5)
        r.run(1.0, cpu_share=0.0)
    assert not r.killed and len(r.event("busy_silent")) == 1


def test_a_worker_that_deadlocks_after_computing_is_killed_once_its_window_goes_idle():
    r = Rig(progress_timeout=60.0)
    r.table.on_heartbeat(r.w, {"state": "ready"})
    r.run(2.0, cpu_share=0.8)                      # computing, then stuck on a lock: CPU idle
    r.run(1.5, cpu_share=0.0)
    assert not r.killed and r.event("busy_silent")  # its last 3 s still hold its work
    r.run(3.5, cpu_share=0.0)                      # at most a window (3 beats) after the work stopped
    assert r.killed and "missed 3 heartbeats" in r.why


def test_a_silent_worker_with_idle_cpu_is_a_deadlock_killed_after_three_beats():
    r = Rig(progress_timeout=60.0)
    r.table.on_heartbeat(r.w, {"state": "ready"})
    r.run(2.9, cpu_share=0.004)                    # poll wake-ups only
    assert not r.killed
    r.run(0.3, cpu_share=0.004)
    assert r.killed and "missed 3 heartbeats (none for 3." in r.why
    assert r.event("busy_silent") == []


def test_a_stopped_worker_is_killed_after_three_beats_of_wall_time_even_when_the_loop_is_late():
    r = Rig(progress_timeout=60.0)
    r.run(1.0, cpu_share=0.5, beat=True)
    r.cpu[r.proc.pid][1] = True                    # SIGSTOP
    r.run(1.0)
    r.stall(2.5)                                   # the loop late too: attention says 1.25 s of silence
    assert r.killed and "the process is stopped" in r.why
    assert "missed 3 heartbeats" in r.why


def test_a_stopped_worker_is_killed_after_three_beats_though_its_last_cpu_sample_advanced():
    r = Rig(progress_timeout=60.0)
    r.table.on_heartbeat(r.w, {"state": "ready"})
    r.run(2.0, cpu_share=0.5)
    r.cpu[r.proc.pid][1] = True
    r.run(1.2, cpu_share=0.5)                      # a stale "advancing" must not excuse a stopped process
    assert r.killed and "stopped" in r.why


def test_psutil_probe_knows_only_its_own_children_and_sees_sigstop():
    table = ProcessTable({}, SETTINGS, FakeSpawner())
    assert table.probe(1) is None                  # not ours
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        cpu, stopped = table.probe(child.pid)
        assert cpu >= 0 and stopped is False
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not table.probe(child.pid)[1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert table.probe(child.pid)[1] is True
    finally:
        child.kill()
        child.wait()
    assert table.probe(child.pid) is None


# -- the tokenizer's side: long texts never hold the GIL, huge ones are refused by their bytes --


@pytest.fixture(scope="module")
def tok(default_model_path):
    return GGUFTokenizer(read_gguf(default_model_path))


def test_a_long_text_tokenizes_with_the_gil_released_and_the_same_ids(tok):
    text = "Kiln runs models locally; ünïcode, 数字 123456 and    spaces.\n" * 8_000       # 500 KB
    gaps, done = [], threading.Event()

    def beat():                                   # what a worker's heartbeat thread needs: turns
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    t = threading.Thread(target=beat)
    t.start()
    t0 = time.monotonic()
    try:
        ids = tok.encode(text, special=False)
    finally:
        took = time.monotonic() - t0
        done.set()
        t.join()
    # held, the GIL would keep the other thread waiting the whole call
    assert len(text) > GIL_FREE_CHARS and max(gaps) < took / 3, f"waited {max(gaps):.2f} s of {took:.2f} s"
    assert ids == tok._tok_plain.encode(text, add_special_tokens=False).ids


def test_a_budget_refuses_a_huge_text_by_its_bytes_without_tokenizing(tok):
    huge = ("The quick brown fox jumps over the lazy dog. " * 80_000)[:3_500_000]
    t0 = time.monotonic()
    with pytest.raises(TooManyTokens) as e, tok.token_budget(8192):
        tok.encode(huge, special=False)
    assert time.monotonic() - t0 < 0.3          # counting bytes, not tokens (tokenizing takes seconds)
    assert e.value.at_least == 3_500_000 // tok.max_token_bytes and e.value.budget == 8192
    assert "at least 43,209 tokens" in str(e.value) and "the context holds 8,192" in str(e.value)
    assert tok.encode("fits", special=False)      # outside the block: no budget


def test_the_byte_bound_never_exceeds_the_true_count(tok):
    """Sound: texts built from the vocabulary's longest tokens, bytes it drops, and random
    Unicode all have at least bytes // max_token_bytes tokens (budget = the true count)."""
    rng = random.Random(35)
    longest = max(range(tok.vocab_size), key=lambda i: len(tok.token_bytes(i)) if not tok.is_control(i) else 0)
    pieces = [tok.token_bytes(longest).decode("utf-8", "replace"), "\x04" * 200, "<|im_start|>", " " * 300,
              "".join(chr(c) for c in rng.sample(range(0x20, 0x2FFFF), 600) if not 0xD800 <= c < 0xE000), "a" * 1000, "\U00040000" * 50]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
        for special in (False, True):
            n = len(tok.encode(text, special=special))
            with tok.token_budget(n):
                tok.encode(text, special=special)        # must not raise
    with tok.token_budget(0):
        assert tok.encode("\x04" * 100_000, special=False) == []   # bytes the vocabulary drops count for nothing
