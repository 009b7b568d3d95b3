"""Models at run time through a real daemon: a request naming a library model loads it while a
stream on another model goes on, `kiln ps` shows both, keep_alive 0 unloads, /v1/models lists
the library; under a budget that holds one model at a time, alternating requests swap them
without a failed request, and a model that cannot fit beside a busy one is refused with the
numbers."""

import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest

from daemon_harness import Daemon, kiln, spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ASK = [{"role": "user", "content": "Name a colour."}]


def post(d, path, body, timeout=120):
    req = urllib.request.Request(d.http + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def ps(d) -> dict:
    out = kiln(d.home, "ps", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for(pred, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def library(home, default_model_path, *names):
    models = home / "models"
    models.mkdir(parents=True, exist_ok=True)
    for n in names:
        (models / f"{n}.gguf").symlink_to(default_model_path)


def stream_tokens(d, model, n, out: dict):
    """A streamed chat of exactly n tokens; records each chunk's arrival time."""
    body = {"model": model, "messages": ASK, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(d.http + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    out["times"], out["finish"] = [], None
    with urllib.request.urlopen(req, timeout=240) as r:
        for line in r:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                for ch in ev["choices"]:
                    if ch["delta"].get("content"):
                        out["times"].append(time.monotonic())
                    out["finish"] = ch.get("finish_reason") or out["finish"]


def test_a_second_model_loads_beside_a_running_stream_then_unloads(default_model_path, tmp_path):
    library(tmp_path, default_model_path, "second")
    with Daemon(tmp_path, {"default": {"kind": "inference", "model": str(default_model_path)}}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=60, what="default loaded")
        got: dict = {}
        t = threading.Thread(target=stream_tokens, args=(d, "default", 200, got))
        t.start()
        wait_for(lambda: len(got.get("times", [])) >= 10, "the stream to start")
        status, r = post(d, "/v1/chat/completions", {"model": "second", "messages": ASK, "max_tokens": 8})
        assert status == 200, r
        assert r["model"] == "second"
        t.join(240)
        gaps = [b - a for a, b in zip(got["times"], got["times"][1:])]
        assert got["finish"] == "length" and len(got["times"]) >= 150
        assert max(gaps) < 1.5, f"the stream stalled {max(gaps):.2f} s while the second model loaded"

        listed = {m["model"]: m for m in ps(d)["models"]}
        assert {"second", default_model_path.stem} <= set(listed), listed
        assert listed[default_model_path.stem]["pinned"] and not listed["second"]["pinned"]
        assert listed["second"]["rss_bytes"] and listed["second"]["expires_at"] > time.time()
        for m in listed.values():     # each worker says how many threads it computes on, and why
            assert 1 <= m["threads"] <= os.cpu_count() and m["other_processes_cores"] >= 0, m

        status, models = 200, json.loads(urllib.request.urlopen(d.http + "/v1/models", timeout=30).read())
        ids = {m["id"] for m in models["data"]}
        assert "second" in ids and "default" in ids

        status, r = post(d, "/v1/chat/completions", {"model": "second", "messages": ASK, "max_tokens": 4,
                                                      "keep_alive": 0})
        assert status == 200, r
        wait_for(lambda: "second" not in {m["model"] for m in ps(d)["models"]}, "second to unload", 30)
        events = [e["event"] for e in d.status()["events"]]
        assert "model_unloaded" in events


def test_a_configured_worker_named_by_alias_lists_its_file_once_and_is_what_its_stem_routes_to(
        default_model_path, tmp_path):
    """`model = "default"` names the library's SmolLM2 file: /v1/models lists that file once (as
    the worker) even before the worker has loaded it, and a request naming the file by its stem
    goes to that worker (stopped here: the error says so) instead of loading a twin."""
    library(tmp_path, default_model_path, default_model_path.stem)
    with Daemon(tmp_path, {"default": {"kind": "inference", "model": "default", "enabled": False}}) as d:
        models = json.loads(urllib.request.urlopen(d.http + "/v1/models", timeout=30).read())["data"]
        assert [m["id"] for m in models] == ["default"], models
        assert models[0]["meta"]["loaded"] is False and models[0]["meta"]["state"] == "stopped"   # not enabled
        status, r = post(d, "/v1/chat/completions", {"model": default_model_path.stem, "messages": ASK,
                                                      "max_tokens": 2})
        assert status == 503 and "worker default is stopped" in r["error"]["message"], r
        assert [w["name"] for w in d.status()["workers"]] == ["default"]        # no twin was placed


@pytest.fixture
def budget_daemon(default_model_path, tmp_path):
    """No model configured; a budget for one model at a time."""
    from kiln.native.models.plan import plan
    library(tmp_path, default_model_path, "alpha", "beta")
    need = plan(default_model_path, 4096)["total_bytes"]
    d = Daemon(tmp_path, {"echo": spec()})
    d.config.write_text(d.config.read_text() + f'\n[models]\nmemory_budget = "{int(need * 1.5)}"\n')
    with d:
        yield d


def test_one_model_at_a_time_swaps_without_a_failed_request(budget_daemon):
    d = budget_daemon
    got: dict = {}
    t = threading.Thread(target=stream_tokens, args=(d, "alpha", 60, got))
    t.start()
    wait_for(lambda: len(got.get("times", [])) >= 3, "alpha to stream")
    # alpha is busy: beta cannot fit beside it, and alpha is never unloaded under a request
    status, r = post(d, "/v1/chat/completions", {"model": "beta", "messages": ASK, "max_tokens": 4})
    assert status == 503 and r["error"]["code"] == "insufficient_memory", r
    assert "GiB" in r["error"]["message"] and "budget" in r["error"]["message"]
    t.join(120)
    assert got["finish"] == "length"
    for model in ("beta", "alpha", "beta", "alpha"):
        status, r = post(d, "/v1/chat/completions", {"model": model, "messages": ASK, "max_tokens": 4})
        assert status == 200, (model, r)
        loaded = [m["model"] for m in ps(d)["models"] if not m.get("unloading")]
        assert loaded == [model], loaded
    events = [e["event"] for e in d.command("events", {"limit": 500})["events"]]
    assert events.count("model_loading") >= 5 and events.count("model_unloaded") >= 3


def test_models_load_unload_and_activate_from_the_cli(budget_daemon):
    d = budget_daemon
    out = kiln(d.home, "models", "load", "alpha")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: any(m["model"] == "alpha" and m["worker_state"] == "ready" for m in ps(d)["models"]), "alpha")
    # its context was sized by the budget (one model's worth at 4,096: not 8,192), and ps says why
    alpha = next(m for m in ps(d)["models"] if m["model"] == "alpha")
    assert alpha["n_ctx"] == 4096 and "8,192 trained" in alpha["context_why"], alpha
    shown = kiln(d.home, "ps").stdout
    assert "4,096" in shown and "context of alpha: 4,096 (of 8,192 trained" in shown, shown
    out = kiln(d.home, "activate", "beta")
    assert out.returncode == 0 and "beta" in out.stdout, out.stderr
    status, r = post(d, "/v1/chat/completions", {"messages": ASK, "max_tokens": 3})   # no model named
    assert status == 200 and r["model"] == "beta", r
    assert json.loads((d.home / "state" / "models.json").read_text())["active_model"] == "beta"
    out = kiln(d.home, "models", "unload", "beta")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: not ps(d)["models"], "every model to unload", 30)
    out = kiln(d.home, "models", "load", "nothing-like-this")
    assert out.returncode != 0 and "not found" in out.stderr
    table = kiln(d.home, "ps")
    assert table.returncode == 0 and "MODEL" in table.stdout


@pytest.mark.parametrize("content, words", [(None, "no such file"), (b"GGUFjunk", "not a GGUF file")])
def test_up_with_a_model_that_cannot_boot_exits_nonzero_with_the_reason(tmp_path, content, words):
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    out = kiln(tmp_path, "up", "--model", str(path), "--port", "0", timeout=60)
    assert out.returncode != 0 and words in out.stderr, out.stderr
    assert "kiln is up" not in out.stderr + out.stdout


def test_config_says_what_the_running_daemon_uses_and_logs_follow_requests(budget_daemon, tmp_path):
    import subprocess
    import sys

    from daemon_harness import env_for
    d = budget_daemon
    other = tmp_path / "other.toml"
    other.write_text("[server]\nport = 8555\n")
    out = kiln(d.home, "config", "--file", str(other))
    assert out.returncode == 0, out.stderr
    port_line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("port ="))
    assert "8555" in port_line and "the running daemon uses 0" in port_line, out.stdout
    assert "a daemon is running" in out.stdout
    follow = subprocess.Popen([sys.executable, "-m", "kiln.supervisor.cli", "logs", "kiln", "-f", "-n", "0"],
                              env=env_for(d.home), stdout=subprocess.PIPE, text=True)
    try:
        status, _ = post(d, "/v1/chat/completions", {"model": "alpha", "messages": ASK, "max_tokens": 2})
        assert status == 200
        got = []

        def read():
            for line in follow.stdout:
                got.append(line)
                if "request POST /v1/chat/completions" in line:
                    return
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(30)
        assert any("request POST /v1/chat/completions" in ln and "status=200" in ln for ln in got), got
    finally:
        follow.kill()
        follow.wait()
    shown = kiln(d.home, "logs", "kiln", "-n", "200").stdout
    assert "request POST /v1/chat/completions" in shown


def test_chat_session_is_saved_resumed_listed_and_shown(budget_daemon):
    import subprocess
    import sys

    from daemon_harness import env_for
    d = budget_daemon

    def chat(text):
        return subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "chat", "--session", "s1",
                               "--model", "alpha", "--max-tokens", "6", "--temperature", "0"],
                              input=text, env=env_for(d.home), capture_output=True, text=True, timeout=120)
    out = chat("Say hi.\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "(new)" in out.stderr
    again = chat("And again.\n")
    assert again.returncode == 0 and "resumed (2 messages)" in again.stderr, again.stderr
    listed = json.loads(kiln(d.home, "sessions", "list", "--json").stdout)
    assert [s["name"] for s in listed] == ["s1"] and listed[0]["turns"] == 2
    shown = kiln(d.home, "sessions", "show", "s1").stdout
    assert "user: Say hi." in shown and "user: And again." in shown and shown.count("assistant:") == 2
    line = json.loads(kiln(d.home, "sessions", "export", "s1").stdout)
    assert [m["role"] for m in line["messages"]] == ["user", "assistant", "user", "assistant"]
    # Ctrl-C during an answer keeps the turn, with what was shown of it (issue 42: it vanished)
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "kiln.supervisor.cli", "chat", "--session", "s1", "--model", "alpha",
                          "--max-tokens", "400", "--temperature", "0"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(d.home), bufsize=1)
    p.stdin.write("Count from one to one hundred, one number per line.\n")
    p.stdin.flush()
    shown, deadline = "", time.monotonic() + 60
    while len(shown.strip()) < 8:                         # a few lines of the answer are on screen
        assert time.monotonic() < deadline, shown
        shown += p.stdout.read(1)
    p.send_signal(signal.SIGINT)
    p.stdin.write("/exit\n")
    p.stdin.close()
    out = p.stdout.read()                                 # through the same buffer as `shown`
    assert p.wait(60) == 0 and "(answer stopped)" in out, (out, p.stderr.read())
    messages = json.loads(kiln(d.home, "sessions", "export", "s1").stdout)["messages"]
    assert [m["role"] for m in messages][-2:] == ["user", "assistant"] and messages[-2]["content"].startswith("Count")
    assert messages[-1]["content"] and messages[-1]["content"].strip() in (shown + out).strip(), messages[-1]
