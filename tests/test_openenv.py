"""`kiln openenv` against real OpenEnv servers (openenv-core's own create_app + uvicorn, in
tests/openenv_server.py) and a real daemon: inspect hashes the discovery documents; a rollout
plays groups from one seed each with schema-constrained actions, verifies offline and replays
live, and fails verify naming the field after one byte changes; train rolls out and trains GRPO through the
trainer worker; a hostile server (oversized observation, socket closed mid-episode, a schema
that is not an object's) ends the run with what happened and keeps what was recorded. Runs the
daemon owns (the evaluator plays them): cancelled, resumed, their evaluator killed mid-run —
and what they record is what an uninterrupted rollout records."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import os
import signal

from daemon_harness import Daemon, http_json, kiln

pytest.importorskip("openenv")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARED_MODES = ("ok", "big", "schema", "drift", "twice")     # one process serves these, each under /MODE


class EnvServer:
    def __init__(self, modes: tuple, log_dir: Path):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # its log goes to a file: a pipe nobody reads fills up and stalls the server
        self.log = log_dir / f"openenv-{'-'.join(modes)}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(HERE / "openenv_server.py"), "--port", str(self.port),
                                          "--mode", *modes], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.base}/{modes[0]}/health", timeout=1).read()
                return
            except OSError:
                assert self.proc.poll() is None, self.log.read_text()
                time.sleep(0.1)
        raise TimeoutError(f"environment server ({modes}) did not start")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class Served:
    def __init__(self, server: EnvServer, mode: str):
        self.url = f"{server.base}/{mode}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """servers(mode).url: the environment in that mode (`die` in a process of its own: it exits)."""
    started, logs = {}, tmp_path_factory.mktemp("openenv-logs")

    def get(mode="ok"):
        modes = SHARED_MODES if mode in SHARED_MODES else (mode,)
        if modes not in started or started[modes].proc.poll() is not None:
            started[modes] = EnvServer(modes, logs)
        return Served(started[modes], mode)
    yield get
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module")
def daemon(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("openenv")
    workers = {"default": {"kind": "inference", "model": str(default_model_path)},
               "trainer": {"kind": "trainer", "model": str(default_model_path)}, "eval": {"kind": "evaluator"}}
    with Daemon(home, workers) as d:
        d.wait(lambda st: all(w["state"] == "running" and w["worker_state"] == "ready" for w in st["workers"]),
               timeout=90, what="workers ready")
        yield d


def rollout(d, url, out, *extra):
    return kiln(d.home, "openenv", "rollout", url, "--out", str(out), "--groups", "2", "--group-size", "2",
                "--seed", "3", "--max-tokens", "40", *extra, timeout=300)


def test_inspect_hashes_each_discovery_document(daemon, servers):
    r = kiln(daemon.home, "openenv", "inspect", servers().url, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d["sha256"]) == {"health", "metadata", "schema"}
    assert d["documents"]["schema"]["action"]["properties"]["message"]["maxLength"] == 24
    assert kiln(daemon.home, "openenv", "inspect", servers().url, "--json").stdout == r.stdout


def test_a_rollout_verifies_offline_and_a_changed_byte_is_named(daemon, servers, tmp_path):
    out = tmp_path / "run"
    r = rollout(daemon, servers().url, out)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    episodes = [json.loads(ln) for ln in (out / "transcript.jsonl").read_text().splitlines()]
    assert summary["complete"] and summary["episodes"] == len(episodes) == 4
    for g in (0, 1):                                   # every candidate of a group from the group's seed
        group = [e for e in episodes if e["group"] == g]
        assert {e["seed"] for e in group} == {3 + g} and len({json.dumps(e["reset"]) for e in group}) == 1
    assert episodes[0]["reset"]["prompt"] == "Say the word cloud." and episodes[2]["reset"]["prompt"] == "Say the word tiger."
    for e in episodes:
        step = e["steps"][0]
        assert len(step["action"]["message"]) <= 24 and e["return"] == step["reward"] in (0.0, 1.0)
    rows = [json.loads(ln) for ln in (out / "dataset.jsonl").read_text().splitlines()]
    assert [[c["reward"] for c in row["completions"]] for row in rows] == [[e["return"] for e in episodes[:2]],
                                                                           [e["return"] for e in episodes[2:]]]
    assert kiln(daemon.home, "openenv", "verify", str(out)).returncode == 0
    r = kiln(daemon.home, "openenv", "replay", str(out), timeout=120)
    assert r.returncode == 0 and "4 episodes and 4 steps as recorded" in r.stdout, r.stderr
    r = kiln(daemon.home, "openenv", "replay", str(out), "--url", servers("drift").url, timeout=120)
    assert r.returncode != 0 and "transcript.jsonl line 1 (group 0 candidate 0): the reset observation" in r.stderr
    data = bytearray((out / "dataset.jsonl").read_bytes())
    data[5] ^= 1
    (out / "dataset.jsonl").write_bytes(bytes(data))
    r = kiln(daemon.home, "openenv", "verify", str(out))
    assert r.returncode != 0 and "sha256.dataset.jsonl" in r.stderr + r.stdout


def test_a_reward_changed_with_its_hash_is_still_caught_by_the_arithmetic(daemon, servers, tmp_path):
    """Someone edits a reward in the dataset and updates the file's hash: the rewards no longer
    follow from the transcript, and verify says which one."""
    import hashlib
    out = tmp_path / "run"
    assert rollout(daemon, servers().url, out).returncode == 0
    rows = [json.loads(ln) for ln in (out / "dataset.jsonl").read_text().splitlines()]
    rows[1]["completions"][0]["reward"] += 5
    data = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in rows).encode()
    (out / "dataset.jsonl").write_bytes(data)
    summary = json.loads((out / "summary.json").read_text())
    summary["sha256"]["dataset.jsonl"] = hashlib.sha256(data).hexdigest()
    (out / "summary.json").write_text(json.dumps(summary))
    r = kiln(daemon.home, "openenv", "verify", str(out))
    assert r.returncode != 0 and "dataset.jsonl line 2 completions[0].reward" in r.stderr + r.stdout


def test_train_rolls_out_then_trains_grpo_in_the_trainer(daemon, servers, tmp_path):
    """Two held-out seeds cannot pass the gate (the sign test's p is at least 0.5 there): the
    adapter's mean return is reported beside the base model's, and --load leaves it unloaded."""
    r = kiln(daemon.home, "openenv", "train", servers().url, "--adapter", "sayer", "--out", str(tmp_path / "run"),
             "--groups", "2", "--group-size", "2", "--max-tokens", "40", "--rank", "4", "--lr", "1e-3",
             "--eval-seeds", "2", "--load", timeout=600)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "adapter sayer is ready" in r.stdout
    ev = json.loads((tmp_path / "run" / "evaluation.json").read_text())
    assert ev["seeds"] == [2, 3] and ev["base_mean"] is not None and ev["adapter_mean"] is not None
    assert f"mean return base {ev['base_mean']:.4g}, sayer {ev['adapter_mean']:.4g}" in r.stdout
    assert "adapter sayer was not loaded" in r.stdout and ev["p_value"] >= 0.5
    assert json.loads(kiln(daemon.home, "adapters", "list", "--json").stdout)["active"] in (None, "")
    for arm in ("eval-base", "eval-adapter"):
        assert kiln(daemon.home, "openenv", "verify", str(tmp_path / "run" / arm)).returncode == 0
    adapters = json.loads(kiln(daemon.home, "adapters", "list", "--json").stdout)["adapters"]
    assert "sayer" in [a["name"] for a in adapters]
    # preflight: the same name again is refused before the environment is touched
    r = kiln(daemon.home, "openenv", "train", servers().url, "--adapter", "sayer", "--out", str(tmp_path / "run2"))
    assert r.returncode != 0 and "exists" in r.stderr and not (tmp_path / "run2").exists()
    r = kiln(daemon.home, "openenv", "train", servers().url, "--adapter", "s2", "--out", str(tmp_path / "run3"),
             "--lr", "7")
    assert r.returncode != 0 and "training settings: training option lr" in r.stderr and not (tmp_path / "run3").exists()


@pytest.mark.parametrize("mode, said, kept", [("big", "over 4194304 bytes", 0),
                                              ("die", "closed the connection mid-episode", 1),
                                              ("schema", "field 'action' must be an object's JSON schema", None)])
def test_a_hostile_environment_ends_the_run_clearly_and_keeps_what_was_recorded(daemon, servers, tmp_path, mode, said,
                                                                                 kept):
    out = tmp_path / "run"
    r = rollout(daemon, servers(mode).url, out)
    assert r.returncode != 0 and said in r.stderr, r.stderr
    if kept is None:
        return
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["complete"] and said in summary["error"] and summary["episodes"] == kept
    assert len((out / "transcript.jsonl").read_text().splitlines()) == kept
    assert kiln(daemon.home, "openenv", "verify", str(out)).returncode == 0   # what was kept still checks
    assert daemon.status()["workers"][0]["state"] == "running"


def test_an_episode_of_several_steps_trains_every_action_with_its_return(daemon, servers, tmp_path):
    """Two steps an episode: the dataset gives each candidate's actions and the observation between
    them as messages (every action learned with the episode's advantage), with the two steps'
    rewards summed; the trainer takes it (queued, then cancelled) and the run verifies."""
    out = tmp_path / "run"
    r = rollout(daemon, servers("twice").url, out, "--max-steps", "2")
    assert r.returncode == 0, r.stderr
    episodes = _episodes(out / "transcript.jsonl")
    rows = [json.loads(ln) for ln in (out / "dataset.jsonl").read_text().splitlines()]
    for row, group in zip(rows, (episodes[:2], episodes[2:])):
        for c, ep in zip(row["completions"], group):
            if len(ep["steps"]) < 2:                   # an action cut short ends the episode at once
                assert c["text"] == ep["steps"][0]["action_text"]
                continue
            assert [m["role"] for m in c["messages"]] == ["assistant", "user", "assistant"]
            assert [c["messages"][0]["content"], c["messages"][2]["content"]] == [s["action_text"] for s in ep["steps"]]
            assert json.loads(c["messages"][1]["content"])["prompt"] == "Say it again."
            assert c["reward"] == ep["return"] == sum(s["reward"] for s in ep["steps"])
    assert any("messages" in c for row in rows for c in row["completions"])
    assert kiln(daemon.home, "openenv", "verify", str(out)).returncode == 0
    r = kiln(daemon.home, "train", "grpo", "--file", str(out / "dataset.jsonl"), "--adapter", "twice", "--json")
    assert r.returncode == 0, r.stderr
    assert kiln(daemon.home, "train", "cancel", json.loads(r.stdout)["id"]).returncode == 0


def _run(d, run_id):
    status, run = http_json(d, "GET", f"/v1/openenv/runs/{run_id}")
    assert status == 200, run
    return run


def _episodes(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_a_run_the_daemon_owns_survives_cancel_resume_and_its_evaluators_death(daemon, servers, tmp_path):
    """Cancelled after 2 of 6 episodes, resumed, its evaluator SIGKILLed after 4: the run ends
    complete, verifies, and recorded exactly the episodes of an uninterrupted `kiln openenv
    rollout` with the same settings (seeds depend only on group, candidate and step)."""
    url = servers().url
    status, run = http_json(daemon, "POST", "/v1/openenv/runs", {"env": url, "groups": 3, "group_size": 2, "seed": 3,
                                                                 "max_tokens": 40})
    assert status == 201 and run["state"] == "queued" and run["total"] == 6, run
    rid = run["id"]
    daemon.wait(lambda st: _run(daemon, rid)["done"] >= 2, 120, "two episodes")
    assert http_json(daemon, "DELETE", f"/v1/openenv/runs/{rid}")[0] == 200
    daemon.wait(lambda st: _run(daemon, rid)["state"] == "cancelled", 120, "the run cancelled")
    run = _run(daemon, rid)
    assert 2 <= run["done"] < 6 and run["summary"]["error"] == "cancelled" and not run["summary"]["complete"]
    status, again = http_json(daemon, "POST", f"/v1/openenv/runs/{rid}")
    assert status == 405
    status, again = http_json(daemon, "POST", f"/v1/openenv/runs/{rid}/resume")
    assert status == 200 and again["state"] == "queued", again
    pid = daemon.worker("eval")["pid"]
    daemon.wait(lambda st: _run(daemon, rid)["done"] >= 4, 120, "four episodes")
    os.kill(pid, signal.SIGKILL)
    daemon.wait(lambda st: _run(daemon, rid)["state"] == "completed", 180, "the run completed")
    run = _run(daemon, rid)
    assert run["resumed"] >= 2 and run["done"] == 6 and run["summary"]["complete"], run
    assert daemon.worker("eval")["pid"] != pid
    folder = daemon.home / "openenv" / "jobs" / rid / "rollout"
    assert kiln(daemon.home, "openenv", "verify", str(folder)).returncode == 0
    out = tmp_path / "whole"
    r = kiln(daemon.home, "openenv", "rollout", url, "--out", str(out), "--groups", "3", "--group-size", "2",
             "--seed", "3", "--max-tokens", "40", timeout=300)
    assert r.returncode == 0, r.stderr
    assert _episodes(folder / "transcript.jsonl") == _episodes(out / "transcript.jsonl")
    assert (folder / "dataset.jsonl").read_bytes() == (out / "dataset.jsonl").read_bytes()
    with urllib.request.urlopen(f"{daemon.http}/v1/openenv/runs/{rid}/artifacts/transcript.jsonl") as resp:
        assert resp.read() == (folder / "transcript.jsonl").read_bytes()
    listed = kiln(daemon.home, "openenv", "runs")
    assert rid in listed.stdout and "completed" in listed.stdout


@pytest.mark.parametrize("body, status, said", [
    ({"env": "ftp://x"}, 400, "env: 'ftp://x' is not an http(s) URL"),
    ({"env": "http://127.0.0.1:9", "groups": 0}, 400, "groups: 0 is not an integer in [1, 10000]"),
    ({"env": "http://127.0.0.1:9", "group_size": 1.5}, 400, "'group_size' must be int"),
    ({"env": "http://127.0.0.1:9", "load": True}, 400, "unknown field(s) ['load']"),
    ({"env": "http://127.0.0.1:9", "train": {"lr": 1e-3}}, 400, "no adapter to train"),
    ({"env": "http://127.0.0.1:9", "adapter": "x", "train": {"lr": 7}}, 400, "training settings: training option lr"),
    ({"env": "http://127.0.0.1:9", "adapter": "../x"}, 400, "adapter: "),
])
def test_a_run_with_bad_settings_is_refused_naming_the_field_and_nothing_is_queued(daemon, body, status, said):
    before = http_json(daemon, "GET", "/v1/openenv/runs")[1]["data"]
    got, err = http_json(daemon, "POST", "/v1/openenv/runs", body)
    assert got == status and said in err["error"]["message"], err
    assert http_json(daemon, "GET", "/v1/openenv/runs")[1]["data"] == before


def test_a_run_whose_environment_is_not_there_fails_saying_so_and_gives_only_its_named_records(daemon):
    status, run = http_json(daemon, "POST", "/v1/openenv/runs", {"env": "http://127.0.0.1:9", "groups": 1})
    assert status == 201, run
    rid = run["id"]
    daemon.wait(lambda st: _run(daemon, rid)["state"] == "failed", 60, "the run failed")
    assert "cannot reach the environment server" in _run(daemon, rid)["error"]
    for name in ("job.json", "..%2Fjob.json", "summary.json"):
        status, err = http_json(daemon, "GET", f"/v1/openenv/runs/{rid}/artifacts/{name}")
        assert status == 404, (name, err)
    assert "has no rollout/summary.json yet" in err["error"]["message"]
    status, err = http_json(daemon, "GET", f"/v1/openenv/runs/{rid}/artifacts/job.json")
    assert "a run has summary.json" in err["error"]["message"]
    for folder in ("..", "../..", "%2Fetc", "rollout%2F.."):          # only the run's own folders
        status, err = http_json(daemon, "GET", f"/v1/openenv/runs/{rid}/artifacts/discovery.json?folder={folder}")
        assert status == 404 and "a run has summary.json" in err["error"]["message"], (folder, err)
    status, again = http_json(daemon, "POST", f"/v1/openenv/runs/{rid}/resume")       # a failed run may go on
    assert status == 200 and again["state"] == "queued" and again["resumed"] == 1
    daemon.wait(lambda st: _run(daemon, rid)["state"] == "failed", 60, "the run failed again")
    for path, method in (("/v1/openenv/runs/openenv-9999", "GET"), ("/v1/openenv/runs/.cancel", "GET"),
                         ("/v1/openenv/runs/openenv-9999/resume", "POST"), ("/v1/openenv/runs/openenv-9999", "DELETE")):
        status, err = http_json(daemon, method, path)
        assert status == 404 and "no OpenEnv run" in err["error"]["message"], (path, err)
