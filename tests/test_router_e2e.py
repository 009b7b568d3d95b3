"""The router against real crashes (end-to-end tier): a real daemon, the default model, SIGKILLs
from outside. One daemon for the module; each test waits for the worker to be ready first."""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

import pytest

from daemon_harness import Daemon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from chaos import run_chaos  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("router")
    workers = {"default": {"kind": "inference", "model": str(default_model_path)},
               "trainer": {"kind": "trainer"}, "evaluator": {"kind": "evaluator"}}
    # the restart policy's own defaults (the harness shortens them for the other tests)
    sv = {"heartbeat_interval": 1.0, "start_secs": 1.0, "backoff_initial": 0.5, "backoff_max": 30.0,
          "max_restarts": 5, "restart_window": 60.0}
    with Daemon(home, workers, supervisor=sv, server={"threads": 24}) as d:
        yield d


def ready(d: Daemon) -> dict:
    return d.wait(lambda st: next((w for w in st["workers"] if w["name"] == "default"
                                   and w["worker_state"] == "ready"), None), timeout=120, what="default ready")


def chat(d: Daemon, text: str, tokens: int = 8) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0}
    req = urllib.request.Request(d.http + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_a_request_right_after_a_sigkill_is_answered_200_three_times_in_a_row(served):
    ready(served)
    for i in range(3):
        # each kill finds the worker `running` (start_secs after its hello): a kill before that
        # would be a failed start, which the policy backs off and may give up on
        pid = served.wait_state("default", "running", timeout=60)["pid"]
        os.kill(pid, signal.SIGKILL)
        status, body = chat(served, f"Say hello number {i}.")
        assert status == 200, body
        assert body["choices"][0]["message"]["content"]
        assert served.worker("default")["pid"] != pid
    served.wait_state("default", "running", timeout=30)
    assert served.worker("default")["restarts"] >= 3


def test_eight_streaming_clients_survive_a_sigkill_every_five_seconds(served):
    ready(served)
    r = run_chaos(served, clients=8, seconds=12, kill_every=5, tokens=40)
    assert r["daemon_alive"] and not r["fatal"], r
    assert r["kills"] >= 2, r
    assert r["streams_without_done"] == 0 and r["cut_streams_missing_error_event"] == 0, r
    assert r["completed_share"] >= 0.4, r
    assert served.worker("default")["state"] != "fatal"


def test_trainer_and_evaluator_hold_no_control_endpoint_or_key(served):
    st = served.status()
    control_key = served.paths.keyfile.read_bytes()
    for name in ("trainer", "evaluator"):
        w = served.wait(lambda st: next((w for w in st["workers"] if w["name"] == name and w["pid"]), None),
                        timeout=30, what=f"{name} up")
        environ = Path(f"/proc/{w['pid']}/environ").read_bytes()
        assert b"control.sock" not in environ and b"KILN_CONTROL_ENDPOINT" not in environ
        assert b"KILN_KEY_FILE=" not in environ and str(served.paths.keyfile).encode() not in environ
        assert control_key not in environ and control_key.hex().encode() not in environ
    assert st["daemon"]["pid"] == served.proc.pid
