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


@pytest.fixture
def two_workers(tmp_path):
    with Daemon(tmp_path, {"a": spec(), "b": spec()}) as d:
        d.wait_state("a", "running")
        d.wait_state("b", "running")
        yield d


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


@pytest.mark.parametrize("inherited_mask", [frozenset(), frozenset({signal.SIGTERM, signal.SIGINT})],
                         ids=["plain", "sigterm-blocked-by-the-parent"])
def test_sigterm_to_the_daemon_leaves_no_orphans_sockets_or_pidfile(tmp_path, inherited_mask):
    d = Daemon(tmp_path, {"a": spec(), "b": spec()}, blocked_signals=inherited_mask).start()
    d.wait_state("a", "running")
    d.wait_state("b", "running")
    pids = [w["pid"] for w in d.status()["workers"]]
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    for pid in pids:
        assert not psutil.pid_exists(pid), f"worker {pid} survived the daemon"
    assert not (d.paths.run / "workers.sock").exists()
    assert not (d.paths.run / "control.sock").exists()
    assert not d.paths.pidfile.exists() and not d.paths.keyfile.exists()


def test_a_second_sigterm_while_stopping_kills_the_workers_at_once(tmp_path):
    import threading
    d = Daemon(tmp_path, {"a": spec()}, supervisor={"graceful_timeout": 60.0}).start()
    try:
        pid = d.wait_state("a", "running")["pid"]

        def busy():                       # an op that ignores cancellation keeps the worker alive
            try:
                with d.client(60) as c:
                    list(c.call("a", "sleep", {"seconds": 30}))
            except Exception:  # noqa: BLE001 - the daemon goes away under it
                pass
        threading.Thread(target=busy, daemon=True).start()
        d.wait(lambda st: st["workers"][0]["worker_state"] == "busy", timeout=10, what="a busy")
        d.proc.send_signal(signal.SIGTERM)
        d.wait(lambda st: st["workers"][0]["state"] == "stopping", timeout=10, what="a stopping")
        assert d.proc.poll() is None and psutil.pid_exists(pid)    # still stopping gracefully
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0 and time.monotonic() - t0 < 3
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert not d.paths.pidfile.exists()
    finally:
        d.stop()


def _call_in_thread(d, op: str, body: dict, out: dict):
    import threading
    from kiln.protocol.client import CommandFailed

    def run():
        try:
            with d.client(60) as c:
                out["reply"] = list(c.call("a", op, body))[-1].body
        except CommandFailed as e:
            out["error"] = e.code
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _busy_daemon(tmp_path, drain: float, seconds: float, out: dict):
    """A daemon whose worker is busy with a `seconds`-long op (its answer goes to `out`)."""
    d = Daemon(tmp_path, {"a": spec()}, supervisor={"drain_timeout": drain}).start()
    try:
        d.wait_state("a", "running")
        t = _call_in_thread(d, "sleep", {"seconds": seconds}, out)
        d.wait(lambda st: st["workers"][0]["worker_state"] == "busy", timeout=10, what="a busy")
    except BaseException:
        d.stop()
        raise
    return d, t


def test_shutdown_lets_a_request_in_flight_finish_and_refuses_new_ones(tmp_path):
    from kiln.protocol.client import CommandFailed
    out = {}
    d, t = _busy_daemon(tmp_path, 30.0, 2, out)
    try:
        r = kiln(tmp_path, "down", timeout=60)
        t.join(10)
        assert r.returncode == 0, r.stderr
        assert "waiting up to" in r.stderr and "1 request(s) in flight" in r.stderr
        assert out == {"reply": {"slept": 2}}, out                   # finished, not cut
        assert "draining" in d.output() and "every request in flight finished" in d.output()
    finally:
        d.stop()
    # while it drains, a new request is refused at once
    out = {}
    d, t = _busy_daemon(tmp_path, 30.0, 3, out)
    try:
        d.proc.send_signal(signal.SIGTERM)
        d.wait(lambda st: st["daemon"]["shutting_down"], timeout=10, what="shutting down")
        with pytest.raises(CommandFailed) as e, d.client(10) as c:
            list(c.call("a", "echo", {"value": 1}))
        assert e.value.code == "shutting_down"
        t.join(10)
        assert out == {"reply": {"slept": 3}} and d.proc.wait(20) == 0
    finally:
        d.stop()


def test_a_request_longer_than_drain_timeout_is_cut_and_down_now_cuts_at_once(tmp_path):
    for args, drain, most in ((("down",), 1.0, 8.0), (("down", "--now"), 30.0, 8.0)):
        out = {}
        d, t = _busy_daemon(tmp_path, drain, 30, out)
        try:
            t0 = time.monotonic()
            r = kiln(tmp_path, *args, timeout=60)
            t.join(10)
            assert r.returncode == 0 and time.monotonic() - t0 < most, (args, r.stderr)
            assert out == {"error": "shutting_down"}, (args, out)
        finally:
            d.stop()


def test_sigusr1_dumps_the_daemons_threads_to_its_log_and_it_keeps_serving(tmp_path):
    with Daemon(tmp_path, {"a": spec()}) as d:
        pid = d.wait_state("a", "running")["pid"]
        d.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "_loop" not in d.output():
            assert time.monotonic() < deadline, d.output()
            time.sleep(0.05)
        assert "kiln-http" in d.output() or "Thread 0x" in d.output()
        assert d.status()["daemon"]["pid"] == d.proc.pid and d.worker("a")["pid"] == pid


def test_sigkill_of_the_daemon_takes_the_workers_down_too(tmp_path):
    d = Daemon(tmp_path, {"a": spec()}).start()
    pid = d.wait_state("a", "running")["pid"]
    d.proc.kill()
    d.proc.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "worker outlived a SIGKILLed supervisor"
        time.sleep(0.05)
    # and the next `kiln up` starts cleanly over the stale pidfile and sockets
    d2 = Daemon(tmp_path, {"a": spec()}).start()
    try:
        d2.wait_state("a", "running")
    finally:
        d2.stop()


def test_second_up_is_refused_unless_plain_detach_and_status_without_daemon_says_so(tmp_path):
    with Daemon(tmp_path, {"a": spec()}) as d:
        r = kiln(tmp_path, "up", "--config", str(d.config))
        assert r.returncode == 1
        assert f"already running (pid {d.proc.pid})" in r.stderr
        r = kiln(tmp_path, "up", "--detach", "--config", str(d.config))     # options may differ: refused
        assert r.returncode == 1 and "already running" in r.stderr
        r = kiln(tmp_path, "up", "--detach")                                # plain: its goal holds, exit 0
        assert r.returncode == 0, r.stderr
        assert f"already up (pid {d.proc.pid}); http://127.0.0.1:" in r.stdout
        assert d.proc.poll() is None
    r = kiln(tmp_path, "status")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "kiln is not running" in r.stderr


def test_detach_then_down(tmp_path):
    from daemon_harness import write_config
    cfg = write_config(tmp_path, {"a": spec()})
    r = kiln(tmp_path, "up", "--detach", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "kiln is up (pid" in r.stdout
    r = kiln(tmp_path, "down")
    assert r.returncode == 0 and "kiln stopped" in r.stdout, r.stderr
    assert kiln(tmp_path, "status").returncode == 1


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
