"""The supervisor with real processes, real ZeroMQ sockets, and signals."""

import os
import signal
import time

import psutil
import pytest
import zmq

from daemon_harness import Daemon, kiln, spec
from kiln.protocol import decode_frames, encode_frames, make
from kiln.supervisor.bus.client import CommandFailed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("two-workers"), {"a": spec(), "b": spec()}) as d:
        yield d


@pytest.fixture
def two_workers(shared_daemon):
    """One daemon for the module's tests of its workers: each starts with both running and idle,
    whatever the test before did to them (killed, stopped, crashed, hung)."""
    d = shared_daemon
    d.wait(lambda st: all(w["state"] == "running" and w["worker_state"] == "ready" for w in st["workers"]),
           timeout=30, what="a and b running and idle")
    return d


def test_kill_9_worker_is_restarted_and_the_others_keep_their_pids(two_workers):
    d = two_workers
    a, b = d.worker("a"), d.worker("b")
    os.kill(a["pid"], signal.SIGKILL)
    new = d.wait(lambda st: next((w for w in st["workers"] if w["name"] == "a" and w["state"] == "running"
                                  and w["pid"] != a["pid"]), None), what="a restarted")
    assert new["restarts"] == a["restarts"] + 1
    assert new["last_exit"]["signal"] == 9
    assert d.worker("b")["pid"] == b["pid"]
    events = [(e["event"], e["worker"]) for e in d.status()["events"]]
    assert ("exited", "a") in events and ("hello", "a") in events


def test_sigstopped_worker_is_declared_dead_after_missed_heartbeats_and_restarted(two_workers):
    d = two_workers
    a = d.worker("a")
    t0 = time.monotonic()
    os.kill(a["pid"], signal.SIGSTOP)
    new = d.wait(lambda st: next((w for w in st["workers"] if w["name"] == "a" and w["state"] == "running"
                                  and w["pid"] != a["pid"]), None), what="a restarted after SIGSTOP")
    took = time.monotonic() - t0
    assert took >= 0.6 - 0.05          # 3 heartbeats of 0.2 s must be missed first
    assert new["last_exit"]["signal"] == 9
    assert any(e["event"] == "killed" and "missed 3 heartbeats" in e["detail"] for e in d.status()["events"])
    assert not psutil.pid_exists(a["pid"]) or psutil.Process(a["pid"]).status() == psutil.STATUS_ZOMBIE


def test_boot_error_exit_3_is_fatal_at_once_with_its_reason(tmp_path):
    with Daemon(tmp_path, {"bad": spec(boot="fail")}) as d:
        w = d.wait_state("bad", "fatal")
        assert w["restarts"] == 0
        assert w["last_exit"]["code"] == 3
        assert "configured to fail at boot" in w["reason"]
        out = kiln(tmp_path, "status")
        assert "fatal" in out.stdout and "configured to fail at boot" in out.stdout


def test_worker_crashing_every_start_goes_fatal_then_restart_revives_it(tmp_path):
    marker = tmp_path / "crash-while-this-exists"
    marker.write_text("x")
    with Daemon(tmp_path, {"flaky": spec(boot="crash_if_file", file=str(marker))},
                supervisor={"max_restarts": 3, "backoff_initial": 0.05, "backoff_max": 0.1}) as d:
        w = d.wait_state("flaky", "fatal", timeout=30)
        assert w["restarts"] == 3 and "max_restarts 3" in w["reason"]
        marker.unlink()
        r = kiln(tmp_path, "restart", "flaky")
        assert r.returncode == 0, r.stderr
        w = d.wait_state("flaky", "running")
        assert w["pid"]


def _raw_socket(d):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.paths.worker_endpoint)
    return s


def test_forged_and_foreign_version_frames_are_refused_and_counted(two_workers):
    d = two_workers
    s = _raw_socket(d)
    forged = encode_frames(make("hello", name="a", kind="test", pid=1, protocol=1, ops=[]), b"wrong key" * 4)
    s.send_multipart(forged)
    s.send_multipart([b"KILN/9"] + forged[1:])
    assert s.poll(5000), "a KILN/9 frame must be answered"
    key = d.paths.worker_keyfile.read_bytes()
    reply = decode_frames(s.recv_multipart(), key)
    assert reply.type == "error" and "KILN/1" in reply.get("message") and "KILN/9" in reply.get("message")
    h = d.wait(lambda st: (hh := d.command("health"))["protocol"]["bad_frames"].get("signature") and hh,
               what="bad frames counted")
    assert h["protocol"]["bad_frames"]["signature"] >= 1 and h["protocol"]["bad_frames"]["version"] >= 1
    assert h["status"] == "ok"
    s.close()


def test_ten_thousand_fuzzed_frames_leave_the_supervisor_healthy(two_workers):
    import random
    d = two_workers
    rng = random.Random(1234)
    s = _raw_socket(d)
    key = d.paths.worker_keyfile.read_bytes()
    good = encode_frames(make("heartbeat"), key)
    for i in range(10_000):
        kind = rng.randrange(4)
        if kind == 0:
            frames = [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(1, 7))]
        elif kind == 1:
            frames = list(good)
            j = rng.randrange(len(frames))
            frames[j] = rng.randbytes(len(frames[j]) or 1)
        elif kind == 2:
            frames = [b"KILN/1", rng.randbytes(64)] + [rng.randbytes(rng.randrange(50)) for _ in range(rng.randrange(1, 5))]
        else:
            frames = good[: rng.randrange(1, len(good))]
        s.send_multipart(frames)
    # the supervisor works through the flood and still serves
    d.wait(lambda st: d.command("health")["protocol"]["bad_frames_total"] >= 9_000, timeout=60,
           what="fuzz frames processed")
    h = d.command("health")
    assert h["status"] == "ok"
    assert [w["state"] for w in d.status()["workers"]] == ["running", "running"]
    with d.client() as c:
        assert [m.body for m in c.call("a", "echo", {"value": 7})][-1]["value"] == 7
    s.close()


def test_a_thousand_chunks_arrive_complete_and_in_order(two_workers):
    with two_workers.client() as c:
        msgs = list(c.call("a", "stream", {"n": 1000, "size": 8}))
    chunks = [m for m in msgs if m.type == "chunk"]
    assert [m.body["i"] for m in chunks] == list(range(1000))
    assert [m.get("seq") for m in chunks] == list(range(1000))
    assert all(m.buffers == [bytes([m.body["i"] % 256]) * 8] for m in chunks)
    assert msgs[-1].type == "reply" and msgs[-1].body == {"n": 1000}


def test_a_request_in_flight_on_a_dying_worker_gets_worker_crashed(two_workers):
    with two_workers.client() as c:
        with pytest.raises(CommandFailed) as e:
            list(c.call("a", "crash", {"after": 0.2}))
    assert e.value.code == "worker_crashed" and e.value.retryable


def test_cancel_reaches_the_worker_between_chunks(two_workers):
    d = two_workers
    with d.client() as c:
        it = c.call("a", "stream", {"n": 100000, "delay": 0.01})
        next(it)
        c.cancel(c.last_call_id)
    d.wait(lambda st: next(w for w in st["workers"] if w["name"] == "a")["worker_state"] == "ready",
           timeout=5, what="worker idle after cancel")


def test_deadline_cancels_a_hung_op(two_workers):
    with two_workers.client() as c:
        t0 = time.monotonic()
        with pytest.raises(CommandFailed) as e:
            list(c.call("a", "hang", {"seconds": 60}, timeout=0.5))
    assert e.value.code == "deadline_exceeded" and time.monotonic() - t0 < 3


def test_unknown_op_and_bad_body_are_clear_errors(two_workers):
    with two_workers.client() as c:
        with pytest.raises(CommandFailed, match="no op 'nope'"):
            list(c.call("a", "nope"))
        with pytest.raises(CommandFailed, match="field 'n' must be int"):
            list(c.call("a", "stream", {"n": "many"}))
        with pytest.raises(CommandFailed, match="no worker named 'zz'"):
            list(c.call("zz", "echo"))


def test_stop_and_start_a_worker(two_workers):
    d = two_workers
    assert kiln(d.home, "stop", "a").returncode == 0
    d.wait_state("a", "stopped")
    assert d.worker("b")["state"] == "running"
    assert kiln(d.home, "start", "a").returncode == 0
    d.wait_state("a", "running")


def test_worker_logs_are_kept_per_worker(two_workers):
    r = kiln(two_workers.home, "logs", "a", "-n", "5")
    assert r.returncode == 0 and 0 < len(r.stdout.splitlines()) <= 5, r.stdout
    r = kiln(two_workers.home, "logs", "a", "-n", "1000")
    assert r.returncode == 0 and "starting test worker a" in r.stdout
    r = kiln(two_workers.home, "logs", "nope")
    assert r.returncode == 1 and "no log for 'nope'" in r.stderr


def test_runtime_dir_key_and_sockets_are_private(two_workers):
    p = two_workers.paths
    assert os.stat(p.run).st_mode & 0o777 == 0o700
    assert os.stat(p.keyfile).st_mode & 0o777 == 0o600
    assert os.stat(p.run / "workers.sock").st_mode & 0o077 == 0


def test_a_worker_may_not_send_up_what_its_kind_is_not_allowed(tmp_path):
    """An evaluator-kind worker asking for adapters.delete gets `forbidden`; its environment holds
    neither the control socket nor the control key."""
    ev = {"kind": "evaluator", "module": "kiln_test_worker", "settings": {}}
    with Daemon(tmp_path, {"ev": ev}) as d:
        d.wait_state("ev", "running")
        with d.client() as c:
            r = [m for m in c.call("ev", "ask_up", {"op": "adapters.delete", "body": {"name": "x"}})][-1].body
            env = [m for m in c.call("ev", "environ", {})][-1].body["environ"]
        assert r["error"] == "forbidden" and "adapters.delete" in r["message"]
        control_key = d.paths.keyfile.read_bytes()
        assert not [k for k, v in env.items() if "control" in v or str(d.paths.keyfile) == v]
        assert "KILN_KEY_FILE" not in env and "KILN_CONTROL_ENDPOINT" not in env
        assert open(env["KILN_WORKER_KEY_FILE"], "rb").read() != control_key


def test_a_request_waits_for_a_restarting_worker_and_is_retried_once_it_is_back(tmp_path):
    """A request in flight when its worker is killed, having produced nothing, runs again on the
    restarted worker; the client sees only the answer (and the router counts the retry)."""
    import threading
    started, release = tmp_path / "started", tmp_path / "release"
    with Daemon(tmp_path, {"a": spec()}) as d:
        pid = d.wait_state("a", "running")["pid"]
        out = {}

        def ask():
            with d.client(60) as c:
                out["r"] = [m for m in c.call("a", "block", {"started": str(started), "release": str(release)},
                                              timeout=60)][-1]
        t = threading.Thread(target=ask)
        t.start()
        d.wait(lambda st: started.exists(), timeout=10, what="the op to start")
        started.unlink()
        os.kill(pid, signal.SIGKILL)
        d.wait(lambda st: started.exists(), timeout=20, what="the op to run again on the new worker")
        release.touch()
        t.join(30)
        assert out["r"].body == {"released": True} and out["r"].get("retried_after") == ["signal 9 (SIGKILL)"]
        st = d.status()
        assert st["workers"][0]["pid"] != pid and st["router"]["retried"] == 1
        assert any(e["event"] == "request_retried" for e in d.command("events", {"after": 0})["events"])
