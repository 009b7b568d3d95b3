"""The OpenAI-compatible API's refusals that need a daemon of their own: a full queue and a model
that cannot load (the shared daemon of test_serving.py serves everything else)."""

import pytest

from daemon_harness import Daemon
from test_serving import QUESTION, _open_stream, inference, post

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_full_queue_answers_503(default_model_path, tmp_path):
    with Daemon(tmp_path, {"default": inference(default_model_path)}, server={"max_queue": 1}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=60, what="ready")
        c, r = _open_stream(d, max_tokens=300)
        r.fp.readline()
        status, err, headers = post(d.http + "/v1/chat/completions",
                                    {"model": "default", "messages": QUESTION, "max_tokens": 2})
        assert status == 503 and err["error"]["code"] == "server_busy" and "Retry-After" in headers
        c.close()


def test_a_bad_model_path_is_fatal_with_its_reason(tmp_path):
    with Daemon(tmp_path, {"default": inference(tmp_path / "missing.gguf")}) as d:
        w = d.wait_state("default", "fatal")
        assert "missing.gguf" in w["reason"] and w["restarts"] == 0
        status, err, _ = post(d.http + "/v1/chat/completions", {"messages": QUESTION})
        assert status == 503 and "fatal" in err["error"]["message"]
