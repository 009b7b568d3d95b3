"""The daemon's own life with real processes and signals: SIGTERM (twice), `kiln down` draining
requests in flight (and --now), SIGUSR1's thread dump, SIGKILL of the daemon, a second `kiln
up`, detach. Each test has a daemon of its own: most end it."""

import signal
import time

import psutil
import pytest

from daemon_harness import Daemon, http_json, kiln, spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


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


def _busy_daemon(tmp_path, drain: float, seconds: float, out: dict, graceful: float | None = None):
    """A daemon whose worker is busy with a `seconds`-long op (its answer goes to `out`);
    `graceful`: how long a worker gets to stop before it is killed."""
    sup = {"drain_timeout": drain, **({"graceful_timeout": graceful} if graceful is not None else {})}
    d = Daemon(tmp_path, {"a": spec()}, supervisor=sup).start()
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
        d, t = _busy_daemon(tmp_path, drain, 30, out, graceful=1.0)    # the op ignores cancellation
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
        log = d.home / "daemon.out"  # the whole log: a dump of every thread is longer than output()'s tail
        deadline = time.monotonic() + 10
        while "_loop" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, d.output()
            time.sleep(0.05)
        assert "Thread 0x" in log.read_text(errors="replace")
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
    pid = int(r.stdout.split("(pid ")[1].split(")")[0])
    r = kiln(tmp_path, "down")
    assert r.returncode == 0 and "kiln stopped" in r.stdout, r.stderr
    # down returns once the daemon's process is gone, not only its pidfile (issue 42)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert kiln(tmp_path, "status").returncode == 1


def test_kiln_serve_runs_one_model_under_its_served_id(tmp_path, default_model_path):
    """`kiln serve FILE --served-model-id smol`: one inference worker (no trainer or evaluator),
    listed by /v1/models as smol, answering requests that name it and those that name none."""
    with Daemon(tmp_path, {}, command="serve", extra_args=(str(default_model_path), "--served-model-id", "smol")) as d:
        d.wait(lambda st: [w["name"] for w in st["workers"]] == ["smol"] and st["workers"][0]["worker_state"] == "ready",
               timeout=90, what="smol served alone")
        status, models = http_json(d, "GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "smol", models
        for named in ({"model": "smol"}, {}):
            status, out = http_json(d, "POST", "/v1/chat/completions", {
                **named, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0})
            assert status == 200 and out["usage"]["completion_tokens"] >= 1, out
    r = kiln(tmp_path, "serve", str(default_model_path), "--served-model-id", "bad name!")
    assert r.returncode == 2 and "--served-model-id" in r.stderr


@pytest.mark.parametrize("level,admitted,frames", [("1", True, False), ("2", True, True), ("-1", False, False)])
def test_verbosity_sets_what_the_daemon_logs(tmp_path, monkeypatch, level, admitted, frames):
    """`kiln -v up` logs each request's routing, `-vv` every worker message too, `-q` warnings
    only (the level travels in KILN_VERBOSITY, as the root options set it)."""
    monkeypatch.setenv("KILN_VERBOSITY", level)
    d = Daemon(tmp_path, {"a": spec()}).start()
    try:
        d.wait_state("a", "running")
        with d.client() as c:
            assert [m.body for m in c.call("a", "echo", {"value": 3})][-1]["value"] == 3
    finally:
        d.stop()
    out = d.output()
    assert ("admitted echo" in out) == admitted, out[-2000:]
    assert ("from worker" in out) == frames, out[-2000:]
    assert ("kiln is up" in out) == (level != "-1")
