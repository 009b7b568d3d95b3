"""Evaluation through a real daemon: the evaluator worker generates through the inference worker
(over the bus), records identities, replays byte for byte, and notices a swapped model file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from conftest import DATA
from daemon_harness import Daemon, http_json as http, kiln

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def daemon(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("eval")
    model = home / "model.gguf"                   # a copy, so that a test can swap the file
    shutil.copyfile(default_model_path, model)
    workers = {"default": {"kind": "inference", "model": str(model)}, "evaluator": {"kind": "evaluator"}}
    with Daemon(home, workers) as d:
        d.wait(lambda st: all(w["state"] == "running" and w["worker_state"] == "ready" for w in st["workers"]),
               timeout=90, what="workers ready")
        d.model = model
        (home / "data").mkdir()                   # over HTTP, data files come from KILN_HOME/data
        shutil.copyfile(DATA / "arith20.json", home / "data" / "arith20.json")
        yield d


def wait_job(d, job_id, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = d.command("eval.job", {"id": job_id})
        if job["state"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise TimeoutError(job_id)


def test_a_malformed_suite_is_rejected_before_any_generation(daemon, tmp_path):
    jobs_before = len(daemon.command("eval.jobs")["jobs"])
    requests_before = daemon.worker("default")["stats"].get("requests", 0)
    suite = json.loads((DATA / "arith20.json").read_text())
    suite["examples"][1] = {"messages": [{"role": "user", "content": "2+2?"}]}          # no target
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(suite))
    r = kiln(daemon.home, "eval", "run", "--file", str(bad))
    assert r.returncode == 1 and "examples[1].target" in r.stderr and "nothing was run" in r.stderr
    suite["examples"][1] = {"messages": [{"role": "user", "content": "2+2?"}], "target": 4,
                            "scorer": {"type": "regex", "pattern": "("}}
    status, body = http(daemon, "POST", "/v1/eval/run", {"inline": suite})
    assert status == 400 and "examples[1].scorer.pattern" in body["error"]["message"]
    assert len(daemon.command("eval.jobs")["jobs"]) == jobs_before
    assert daemon.worker("default")["stats"].get("requests", 0) == requests_before


@pytest.fixture(scope="module")
def arith_job(daemon) -> dict:
    """The arithmetic suite run once on the module's model, whichever test asks first."""
    r = kiln(daemon.home, "eval", "run", "--file", str(DATA / "arith20.json"), "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_arithmetic_suite_runs_end_to_end_and_replays_byte_identically(daemon, arith_job):
    job = arith_job
    m = job["metrics"]["base"]
    assert m["n"] == 20 and sum(m["counts"].values()) == 20 and m["counts"]["error"] == 0
    lo, hi = m["accuracy_ci95"]
    assert lo <= m["accuracy"] <= hi and set(m["pass_rate_by_tag"]) == {"add", "mul"}
    assert m["latency_s"]["p50"] > 0 and m["completion_tokens"] > 0
    ids = job["identities"]
    assert len(ids["model_sha256"]) == 64 and ids["generation"]["temperature"] == 0 and ids["suite_sha256"]
    detail = daemon.command("eval.job", {"id": job["id"]})
    assert len(detail["results"]) == 20 and all(isinstance(x["text"], str) for x in detail["results"])
    r = kiln(daemon.home, "eval", "replay", job["id"], timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("matched"), r.stdout + r.stderr


def test_killing_the_evaluator_mid_run_fails_the_job_with_a_reason_and_the_next_run_works(daemon):
    status, job = http(daemon, "POST", "/v1/eval/run", {"file": "arith20.json", "seed": 3})
    assert status == 201, job
    deadline = time.monotonic() + 120
    while daemon.command("eval.job", {"id": job["id"]})["done"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ev = daemon.worker("evaluator")
    os.kill(ev["pid"], signal.SIGKILL)
    failed = wait_job(daemon, job["id"], 60)
    assert failed["state"] == "failed" and "stopped during the run" in failed["error"], failed
    status, again = http(daemon, "POST", "/v1/eval/run", {"file": "arith20.json", "seed": 3})
    assert status == 201
    done = wait_job(daemon, again["id"])
    assert done["state"] == "completed", done
    status, listed = http(daemon, "GET", "/v1/eval/jobs")
    assert again["id"] in [j["id"] for j in listed["data"]]


def test_the_evaluator_holds_no_copy_of_the_weights(daemon):
    st = daemon.wait(lambda s: all(w["rss_bytes"] for w in s["workers"]) and s, timeout=30, what="RSS sampled")
    st = {w["name"]: w for w in st["workers"]}
    model_bytes = daemon.model.stat().st_size
    assert st["evaluator"]["rss_bytes"] < model_bytes / 2, (st["evaluator"]["rss_bytes"], model_bytes)
    assert st["evaluator"]["rss_bytes"] < st["default"]["rss_bytes"] / 2


def _load(daemon, source) -> None:
    """Put `source` in place of the module's model file and restart the inference worker on it."""
    tmp = daemon.model.with_suffix(".swap")
    shutil.copyfile(source, tmp)
    os.replace(tmp, daemon.model)
    old = daemon.worker("default")["pid"]
    assert kiln(daemon.home, "restart", "default").returncode == 0
    daemon.wait(lambda st: any(w["name"] == "default" and w["state"] == "running" and w["worker_state"] == "ready"
                               and w["pid"] not in (None, old) for w in st["workers"]), timeout=90,
                what="swapped model loaded")


def test_replay_after_the_model_file_is_swapped_is_an_error_not_a_mismatch(daemon, arith_job, e8k8_path,
                                                                           default_model_path):
    _load(daemon, e8k8_path)
    try:
        r = kiln(daemon.home, "eval", "replay", arith_job["id"], "--json", timeout=300)
        assert r.returncode == 1
        out = json.loads(r.stdout)
        assert out["verdict"] == "error" and "model changed" in out["verdict_detail"][0], out
    finally:
        _load(daemon, default_model_path)          # the other tests see the module's own model
