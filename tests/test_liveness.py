"""Liveness against real daemons: a busy machine is not a hung worker (issue 35, item 6).

- 8 CPU-bound processes beside a ~1,500-token prefill and two streams: no worker is restarted.
- A 3.5 MB prompt is refused (400 context_length_exceeded) within a second, with no restart.
- A SIGSTOPped worker is still caught within 3 heartbeats of 1 s.
- A worker whose op holds the GIL while computing (CPU time advancing) is spared until
  progress_timeout, then killed; one that holds it blocked (no CPU) is killed after 3 beats.
The rules themselves, with a fake clock: tests/test_liveness_rules.py."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from daemon_harness import Daemon

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

HUGE = ("The quick brown fox jumps over the lazy dog. " * 80_000)[:3_500_000]       # under the 4 MB body limit
LONG = "Kiln is a local runtime. " * 214                                            # ~1,500 tokens
BURN_S = 9.0
PROGRESS_S = 6.0        # progress_timeout of the GIL tests: room for 1.5 s of CPU at a loaded machine's share


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("liveness")
    with Daemon(home, {"default": {"kind": "inference", "model": str(default_model_path)}},
                supervisor={"heartbeat_interval": 1.0, "liveness": 3, "start_secs": 1.0}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=120, what="model loaded")
        yield d


@pytest.fixture(scope="module")
def gil_daemon(tmp_path_factory):
    home = tmp_path_factory.mktemp("liveness-gil")
    with Daemon(home, {"a": {"kind": "test", "module": "liveness_worker"}},
                supervisor={"heartbeat_interval": 0.2, "liveness": 3, "progress_timeout": PROGRESS_S}) as d:
        d.wait_state("a", "running")
        yield d


def post(d, path: str, body: dict, timeout: float = 300) -> tuple[int, bytes]:
    req = urllib.request.Request(d.http + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()               # a stream is read to its end
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def worker(d, name: str = "default") -> dict:
    return d.worker(name)


def killed(d, name: str) -> list[dict]:
    return [e for e in d.status()["events"] if e["event"] == "killed" and e["worker"] == name]


def test_a_huge_prompt_is_refused_at_once_and_no_worker_is_restarted(served):
    before = worker(served)
    for path, body, param in [("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
                              ("/v1/completions", {"prompt": HUGE}, "prompt")]:
        t0 = time.monotonic()
        status, raw = post(served, path, {"model": "default", "max_tokens": 8, **body})
        took = time.monotonic() - t0
        err = json.loads(raw)["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, raw[:300]
        assert "at least" in err["message"] and "the context holds" in err["message"]
        assert took < 1.0, f"{path}: answered in {took:.2f} s"
    after = worker(served)
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])


def test_a_busy_machine_kills_no_worker(served):
    """8 CPU-bound processes for the first BURN_S seconds of a ~1,500-token prefill and two
    streams (3 liveness windows of 3 s, each judged on its own; the whole prefill under that
    load would take 1.5-3 minutes on 2 shared cores), then the requests finish unloaded."""
    before = worker(served)
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(8)]
    results: dict[str, tuple[int, bytes]] = {}
    try:
        jobs = {"prefill": {"prompt": LONG, "max_tokens": 2, "temperature": 0},
                "stream1": {"prompt": "Once upon a time", "max_tokens": 8, "stream": True},
                "stream2": {"prompt": "One, two, three,", "max_tokens": 8, "stream": True}}
        threads = [threading.Thread(target=lambda k=k, b=b: results.__setitem__(
            k, post(served, "/v1/completions", {"model": "default", **b})), daemon=True) for k, b in jobs.items()]
        for t in threads:
            t.start()
        burn_until = time.monotonic() + BURN_S
        for t in threads:
            t.join(max(0.0, burn_until - time.monotonic()))
        loaded = worker(served)                  # judged while the machine is still busy
        assert (loaded["pid"], loaded["restarts"]) == (before["pid"], before["restarts"]), killed(served, "default")
    finally:
        for b in burners:
            b.kill()
            b.wait()
    deadline = time.monotonic() + 240
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert set(results) == set(jobs), f"unfinished: {set(jobs) - set(results)}"
    assert all(status == 200 for status, _ in results.values()), results
    assert json.loads(results["prefill"][1])["usage"]["prompt_tokens"] >= 1400
    assert all(raw.rstrip().endswith(b"data: [DONE]") for k, (_, raw) in results.items() if k.startswith("stream"))
    after = worker(served)
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"]), killed(served, "default")


def test_a_sigstopped_worker_is_caught_within_three_heartbeats(served):
    """Last in the module: it costs the model worker a restart."""
    pid = worker(served)["pid"]
    t0 = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        got = served.wait(lambda st: [e for e in st["events"] if e["event"] == "killed" and e["worker"] == "default"],
                          timeout=15, what="the stopped worker killed")
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)
    assert "missed 3 heartbeats" in got[-1]["detail"] and "stopped" in got[-1]["detail"]
    assert got[-1]["ts"] - t0 <= 3.5, f"caught after {got[-1]['ts'] - t0:.2f} s"


def _call(d, op: str, body: dict) -> threading.Thread:
    """Call an op of worker a in the background (the test watches the worker, not the answer)."""
    def run():
        try:
            with d.client(60) as c:
                list(c.call("a", op, body, timeout=60))
        except Exception:  # noqa: BLE001 - a killed worker's error is expected here
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_worker_computing_with_the_gil_held_is_spared_until_progress_timeout(gil_daemon):
    d = gil_daemon
    before = d.worker("a")
    _call(d, "compute_holding_gil", {"seconds": 1.5}).join(30)     # 7 heartbeats' silence, CPU busy
    after = d.worker("a")
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"]), killed(d, "a")
    assert any(e["event"] == "busy_silent" and e["worker"] == "a" for e in d.status()["events"])


def test_a_worker_computing_with_the_gil_held_past_progress_timeout_is_killed(gil_daemon, tmp_path):
    d = gil_daemon
    before = d.worker("a")
    t0 = time.time()
    _call(d, "compute_holding_gil", {"seconds": 60, "once": str(tmp_path / "once")})
    got = d.wait(lambda st: [e for e in st["events"] if e["event"] == "killed" and e["worker"] == "a"
                             and e["ts"] > t0], timeout=20, what="the spinning worker killed")
    assert f"CPU time kept advancing (progress_timeout {PROGRESS_S:g} s)" in got[-1]["detail"]
    assert PROGRESS_S - 0.5 <= got[-1]["ts"] - t0 < PROGRESS_S + 5     # from the last heartbeat, before t0
    d.wait(lambda st: st["workers"][0]["state"] == "running" and st["workers"][0]["pid"] != before["pid"],
           timeout=20, what="a back")


def test_a_worker_blocked_with_the_gil_held_is_killed_after_three_beats(gil_daemon, tmp_path):
    d = gil_daemon
    d.wait_state("a", "running")
    t0 = time.time()
    _call(d, "block_holding_gil", {"seconds": 10, "once": str(tmp_path / "once")})
    got = d.wait(lambda st: [e for e in st["events"] if e["event"] == "killed" and e["worker"] == "a"
                             and e["ts"] > t0], timeout=20, what="the blocked worker killed")
    assert "missed 3 heartbeats" in got[-1]["detail"]
    assert got[-1]["ts"] - t0 < 3.0
    assert not any(e["event"] == "busy_silent" and e["ts"] > t0 for e in d.status()["events"])
