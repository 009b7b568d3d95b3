"""A model split into two processes on one machine (`split = 2`, issue 41 item 4), through a real
`kiln up`: the same greedy text as the whole model on every door, the rows crossing as raw frames
through the router, and a later stage killed mid-conversation coming back without the client
seeing it."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from daemon_harness import Daemon, http_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_path):
    home = tmp_path_factory.mktemp("pipeline")
    model = str(default_model_path)
    d = Daemon(home, {"whole": {"kind": "inference", "model": model, "settings": {"ctx": 1024}},
                      "sp": {"kind": "inference", "model": model, "split": 2,
                             # the parts of a prompt overlapped even on one machine: the path a
                             # split over two machines takes (auto leaves it to those)
                             "settings": {"ctx": 1024, "pipeline_prefill": True}}},
               supervisor={"heartbeat_interval": 0.5, "liveness": 6, "start_secs": 0.3})
    d.start()
    try:
        for name in ("whole", "sp", "sp.stage1"):
            d.wait(lambda st, n=name: next((w for w in st["workers"] if w["name"] == n and w["state"] == "running"
                                            and w["worker_state"] == "ready"), None), 60, f"{name} ready")
        yield d
    finally:
        d.stop()


def _chat(d, model, text, n=40, **extra):
    status, out = http_json(d, "POST", "/v1/chat/completions",
                            {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": n,
                             "temperature": 0, **extra})
    assert status == 200, out
    return out


def _stream(d, model, text, n=40) -> str:
    req = urllib.request.Request(d.http + "/v1/chat/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": model, "stream": True, "max_tokens": n, "temperature": 0,
                                                  "messages": [{"role": "user", "content": text}]}).encode())
    parts = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                    parts.append(ev["choices"][0]["delta"]["content"])
    return "".join(parts)


def test_the_split_model_writes_the_whole_models_text(served):
    long = "Summarize this: " + " ".join(f"On day {i} the baker made {i * 3} loaves of rye bread." for i in range(20))
    for text in ("Write a haiku about the sea.", "List three prime numbers and explain why they are prime.", long):
        whole, split = _chat(served, "whole", text), _chat(served, "sp", text)
        assert whole["choices"][0]["message"]["content"] == split["choices"][0]["message"]["content"]
        for k in ("prompt_tokens", "completion_tokens"):       # (how many drafts were checked may differ: timing)
            assert whole["usage"][k] == split["usage"][k]
    assert _stream(served, "whole", "Name four rivers.") == _stream(served, "sp", "Name four rivers.")
    front = served.command("call", {"worker": "sp", "op": "stats"})        # asked now, not a heartbeat's
    stage = served.command("call", {"worker": "sp.stage1", "op": "stats"})
    assert front["stages"] == ["sp.stage1"] and front["stage_calls"] > 0
    n_embd_bytes = front["stage_bytes_out"] / max(1, stage["rows"])
    assert n_embd_bytes == 576 * 4                       # raw float32 rows, nothing else
    assert stage["layers"] == [15, 30] and stage["calls"] >= front["stage_calls"] - 1
    assert stage["rows"] > stage["calls"]                 # the long prompt went in parts of many rows
    models = {m["id"] for m in http_json(served, "GET", "/v1/models")[1]["data"]}
    assert "sp" in models and "sp.stage1" not in models   # a stage is not a model clients name


def test_a_later_stage_killed_mid_conversation_comes_back_unseen(served):
    text = "Tell me about the moon."
    before = _chat(served, "sp", text, 24)["choices"][0]["message"]["content"]
    pid = served.worker("sp.stage1")["pid"]
    os.kill(pid, signal.SIGKILL)
    served.wait(lambda st: next((w for w in st["workers"] if w["name"] == "sp.stage1" and w["pid"] not in (None, pid)
                                 and w["worker_state"] == "ready"), None), 60, "the stage back")
    # the first stage still holds the conversation's prefix; the new stage holds nothing: it is
    # sent every position again, and the answer is the one the whole model gives
    after = _chat(served, "sp", text, 24)["choices"][0]["message"]["content"]
    assert after == before == _chat(served, "whole", text, 24)["choices"][0]["message"]["content"]
