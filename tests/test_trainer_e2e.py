"""LoRA fine-tuning through a real daemon: a trainer worker beside an inference worker.

It learns a made-up fact, serves it through `kiln run --adapter`, survives a graceful restart and
kill -9 mid-job with a bit-identical result, refuses bad data with line numbers, and never stops
inference."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import DATA
from daemon_harness import Daemon, http_json as http, kiln
from kiln.native.lora import load_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

QUESTION = "What is the Zorblax access code?"
OPTIONS = ["--lr", "2e-3", "--epochs", "1", "--grad-accum", "4", "--seed", "7"]


@pytest.fixture(scope="module")
def daemon(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("train")
    workers = {"default": {"kind": "inference", "model": str(default_model_path)},
               "trainer": {"kind": "trainer", "model": str(default_model_path)},
               "evaluator": {"kind": "evaluator"}}
    with Daemon(home, workers) as d:
        d.wait(lambda st: all(w["state"] == "running" and w["worker_state"] == "ready" for w in st["workers"]),
               timeout=90, what="workers ready")
        yield d


def submit(d, adapter, *extra) -> str:
    r = kiln(d.home, "train", "sft", "--file", str(DATA / "zorblax.jsonl"), "--adapter", adapter, *OPTIONS, *extra,
             "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["id"]


def wait_job(d, job_id, states=("completed", "failed", "cancelled"), timeout=600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = d.command("train.job", {"id": job_id})
        if job["state"] in states:
            return job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} still {job['state']} at step {job['step']}")


def ask(d, *adapter) -> str:
    r = kiln(d.home, "run", *adapter, "-t", "0", "--max-tokens", "24", QUESTION, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_bad_data_is_refused_with_line_numbers_and_nothing_is_queued(daemon, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
        "{not json",
        json.dumps({"messages": [{"role": "pilot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": "long " * 600}, {"role": "assistant", "content": "y"}]}),
    ]) + "\n")
    r = kiln(daemon.home, "train", "sft", "--file", str(bad), "--adapter", "bad")
    assert r.returncode == 1
    for line, why in [(2, "not valid JSON"), (3, "'pilot'"), (4, "no assistant turn"), (5, "content is empty"),
                      (6, "longer than max_seq_len 512")]:
        assert f"line {line}: " in r.stderr and why in r.stderr, r.stderr
    assert "line 1:" not in r.stderr and "nothing was queued" in r.stderr
    # over HTTP the data comes in the body, or from a file in KILN_HOME/data
    status, body = http(daemon, "POST", "/v1/train/sft", {"data": bad.read_text(), "adapter": "bad"})
    assert status == 400 and body["error"]["code"] == "bad_data" and "line 3:" in body["error"]["message"]
    (daemon.home / "data").mkdir(exist_ok=True)
    shutil.copyfile(bad, daemon.home / "data" / "bad.jsonl")
    status, body = http(daemon, "POST", "/v1/train/sft", {"file": "bad.jsonl", "adapter": "bad", "epochs": 0})
    assert status == 400 and "epochs" in body["error"]["message"]
    status, body = http(daemon, "POST", "/v1/train/sft", {"file": "bad.jsonl", "adapter": "bad"})
    assert status == 400 and body["error"]["code"] == "bad_data" and "line 3:" in body["error"]["message"]
    assert not [j for j in daemon.command("train.jobs")["jobs"] if j["adapter"] == "bad"]


@pytest.fixture(scope="module")
def zorb(daemon) -> dict:
    """The adapter "zorb", trained once for the module whichever test asks first, with what was
    seen while it trained (inference answered; the losses)."""
    before = ask(daemon)
    job_id = submit(daemon, "zorb")
    answered_while_training, asked = 0, 0.0
    while (job := daemon.command("train.job", {"id": job_id}))["state"] in ("queued", "running"):
        if job["state"] == "running" and time.monotonic() - asked >= 2.0:   # now and then: every
            status, body = http(daemon, "POST", "/v1/chat/completions",    # answer takes CPU from the training
                                {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
            assert status == 200, body
            answered_while_training += 1
            asked = time.monotonic()
        time.sleep(0.2)
    return {"job": job, "before": before, "answered_while_training": answered_while_training}


def test_it_learns_the_fact_and_inference_answers_throughout(daemon, zorb):
    assert "4721" not in zorb["before"]
    job = zorb["job"]
    assert job["state"] == "completed", job
    assert zorb["answered_while_training"] >= 2
    losses = [rec["loss"] for rec in job["losses"]]
    assert len(losses) == job["total_steps"] == 8
    assert losses[-1] < 0.2 * losses[0], losses
    assert "4721" in ask(daemon, "--adapter", "zorb")
    assert "4721" not in ask(daemon, "--adapter", "")
    status, body = http(daemon, "GET", f"/v1/train/jobs/{job['id']}")
    assert status == 200 and body["state"] == "completed" and len(body["losses"]) == 8


def test_eval_compare_of_base_and_adapter_reports_flips_and_a_p_value(daemon, zorb):
    suite = str(DATA / "zorblax_suite.json")
    r = kiln(daemon.home, "eval", "compare", "--file", suite, "--adapter", "", "--adapter", "zorb", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)
    cmp = job["comparison"]["base -> zorb"]
    assert cmp["improved"] >= 4 and cmp["improved"] > cmp["regressed"], cmp
    assert 0 < cmp["sign_test_p"] < 1
    assert job["metrics"]["zorb"]["pass_rate_by_tag"]["zorblax"]["rate"] > job["metrics"]["base"]["pass_rate_by_tag"]["zorblax"]["rate"]
    assert job["identities"]["adapters"]["zorb"] and len(job["identities"]["adapters"]["zorb"]) == 64
    r = kiln(daemon.home, "eval", "compare", "--file", suite, "--adapter", "zorb", "--adapter", "zorb", "--json", timeout=300)
    same = json.loads(r.stdout)["comparison"]["zorb -> zorb"]
    assert same["improved"] == same["regressed"] == 0 and same["sign_test_p"] == 1.0


def test_adapters_load_unload_and_delete_refused_while_active(daemon, zorb):
    listed = json.loads(kiln(daemon.home, "adapters", "list", "--json").stdout)
    zorb = next(a for a in listed["adapters"] if a["name"] == "zorb")
    assert zorb["rank"] == 16 and zorb["base_model"].startswith("SmolLM2") and not zorb["active"]
    assert kiln(daemon.home, "adapters", "load", "zorb").returncode == 0
    assert "4721" in ask(daemon)                     # the active adapter applies to every request
    status, body = http(daemon, "POST", "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 16})
    assert "4721" in body["choices"][0]["message"]["content"]
    r = kiln(daemon.home, "adapters", "delete", "zorb")
    assert r.returncode == 1 and "active" in r.stderr
    assert kiln(daemon.home, "adapters", "unload").returncode == 0
    assert "4721" not in ask(daemon)
    status, body = http(daemon, "POST", "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": QUESTION}], "adapter": "nope", "max_tokens": 4})
    assert status == 404 and body["error"]["code"] == "adapter_not_found"
    status, body = http(daemon, "GET", "/v1/adapters")
    assert status == 200 and body["active"] is None and "zorb" in [a["name"] for a in body["data"]]
    # embeddings take a request's adapter too: the LoRA moves the hidden states they pool
    vec = {a: http(daemon, "POST", "/v1/embeddings", {"input": QUESTION, **({"adapter": a} if a is not None else {})})
           for a in (None, "", "zorb")}
    assert all(s == 200 for s, _ in vec.values()), vec
    base, none, tuned = (np.array(b["data"][0]["embedding"]) for _, b in vec.values())
    assert np.array_equal(base, none) and not np.allclose(base, tuned, atol=1e-3)
    status, body = http(daemon, "POST", "/v1/embeddings", {"input": QUESTION, "adapter": "nope"})
    assert status == 404 and body["error"]["code"] == "adapter_not_found"


def test_a_graceful_restart_then_kill_9_in_one_job_resume_to_a_bit_identical_adapter(daemon, zorb):
    """One job, stopped twice: `kiln restart trainer` pauses it with a checkpoint; the next
    trainer resumes it and writes its periodic checkpoint (every 2 steps); kill -9 then — and
    the trainer after it resumes from that checkpoint. The adapter is zorb's bits."""
    job_id = submit(daemon, "zorb-resumed", "--checkpoint-interval", "2")
    ckpt = Path(daemon.home) / "train" / "jobs" / job_id / "checkpoint.npz"
    deadline = time.monotonic() + 300
    while daemon.command("train.job", {"id": job_id})["step"] < 3:
        assert time.monotonic() < deadline, "the job did not reach step 3"
        time.sleep(0.1)
    first = daemon.worker("trainer")["pid"]
    assert kiln(daemon.home, "restart", "trainer").returncode == 0
    daemon.wait(lambda st: any(w["name"] == "trainer" and w["pid"] not in (None, first) for w in st["workers"]),
                timeout=60, what="trainer restarted")
    # paused with a checkpoint (not killed: the trainer asks for the time to write it)
    assert daemon.worker("trainer")["last_exit"]["code"] == 0
    job = daemon.command("train.job", {"id": job_id})
    assert job["pauses"] == 1 and 3 <= job["paused_at_step"] < 6 and ckpt.exists(), job
    at_pause = ckpt.stat()
    while (s := ckpt.stat()).st_mtime_ns == at_pause.st_mtime_ns and s.st_ino == at_pause.st_ino:
        assert time.monotonic() < deadline, "the resumed job wrote no periodic checkpoint"
        time.sleep(0.05)
    second = daemon.worker("trainer")["pid"]
    os.kill(second, signal.SIGKILL)
    daemon.wait(lambda st: any(w["name"] == "trainer" and w["pid"] not in (None, second) for w in st["workers"]),
                timeout=60, what="trainer restarted after kill -9")
    assert daemon.worker("trainer")["last_exit"]["signal"] == 9
    job = wait_job(daemon, job_id)
    assert job["state"] == "completed" and job["pauses"] == 1, job
    assert [rec["step"] for rec in job["losses"]] == list(range(1, 9))
    assert not ckpt.exists()                             # a completed job leaves no checkpoint
    a = load_adapter(Path(daemon.home) / "adapters" / "zorb.gguf")
    b = load_adapter(Path(daemon.home) / "adapters" / "zorb-resumed.gguf")
    assert list(a.tensors) == list(b.tensors)
    for n in a.tensors:
        for x, y in zip(a.tensors[n], b.tensors[n]):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), n
    assert kiln(daemon.home, "adapters", "delete", "zorb-resumed").returncode == 0
    assert "zorb-resumed" not in [a["name"] for a in daemon.command("adapters.list")["adapters"]]


def test_cancel_a_running_and_a_queued_job_and_delete(daemon):
    long_id = submit(daemon, "long", "--epochs", "50")
    queued_id = submit(daemon, "queued")
    wait_job(daemon, long_id, states=("running",), timeout=120)
    r = kiln(daemon.home, "train", "cancel", queued_id)
    assert r.returncode == 0, r.stderr
    status, _ = http(daemon, "DELETE", f"/v1/train/jobs/{long_id}")
    assert status == 200
    assert wait_job(daemon, long_id, timeout=60)["state"] == "cancelled"
    assert wait_job(daemon, queued_id, timeout=60)["state"] == "cancelled"
    names = [a["name"] for a in daemon.command("adapters.list")["adapters"]]
    assert "long" not in names and "queued" not in names
    assert kiln(daemon.home, "train", "cancel", long_id).returncode == 1       # already cancelled


def test_a_grpo_job_on_six_groups_completes_and_its_adapter_is_listed(daemon, tmp_path):
    names = ["Ada", "Bob", "Cy", "Dee", "Eve", "Fay"]
    groups = [{"prompt": [{"role": "user", "content": f"Greet {n}."}],
               "completions": [{"text": f"Hello {n}!", "reward": 1.0}, {"text": f"Go away {n}.", "reward": 0.0}]}
              for n in names]
    f = tmp_path / "groups.jsonl"
    f.write_text("\n".join(json.dumps(g) for g in groups) + "\n")
    r = kiln(daemon.home, "train", "grpo", "--file", str(f), "--adapter", "greeter", "--rank", "4",
             "--lr", "1e-3", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    job = wait_job(daemon, json.loads(r.stdout)["id"])
    assert job["state"] == "completed", job
    assert job["total_steps"] == 6 and job["reward"] == 0.5 and job["kl"] >= 0
    assert job["spec"]["method"] == "grpo"
    listed = json.loads(kiln(daemon.home, "adapters", "list", "--json").stdout)["adapters"]
    assert "greeter" in [a["name"] for a in listed]
    status = kiln(daemon.home, "train", "status").stdout
    assert "reward 0.500" in status


def test_adapter_smoke_test_answers_with_and_without_the_new_adapter(daemon, tmp_path):
    """--adapter-smoke-test follows the job, then answers each prompt greedily with the base model
    and with the adapter it made (a one-step job: the point is the handoff, not the learning)."""
    one = tmp_path / "one.jsonl"
    one.write_text((DATA / "zorblax.jsonl").read_text().splitlines()[0] + "\n")
    r = kiln(daemon.home, "train", "sft", "--file", str(one), "--adapter", "smoke", "--lr", "1e-3",
             "--adapter-smoke-test", QUESTION, "--adapter-smoke-test", "Say hi", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    smoke = json.loads(r.stdout.strip().splitlines()[-1])["smoke_test"]
    assert [s["prompt"] for s in smoke] == [QUESTION, "Say hi"]
    assert all(s["base"] and s["adapter"] for s in smoke)
    base = kiln(daemon.home, "run", "-t", "0", "--max-tokens", "64", "--adapter", "", QUESTION, timeout=120)
    assert base.returncode == 0 and base.stdout.strip() == smoke[0]["base"], (base.stdout, smoke[0])
    assert kiln(daemon.home, "adapters", "delete", "smoke").returncode == 0


def test_an_opd_job_learns_from_this_daemons_own_api_as_its_teacher(daemon, tmp_path, student_path):
    """On-policy distillation with a URL teacher: the two-layer student samples in the trainer,
    the daemon's own /v1/completions (the whole default model) scores every sampled token by id;
    the held-out KL is measured before and after (the sampled estimate: the teacher is remote)."""
    def write(name, topics):
        f = tmp_path / name
        f.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"One sentence about {t}."}]})
                             + "\n" for t in topics))
        return f
    train, held = write("p.jsonl", ["the sea", "a cat", "bread", "rain"]), write("h.jsonl", ["trees", "the moon"])
    common = ["--file", str(train), "--model", str(student_path), "--samples", "2", "--max-new-tokens", "8",
              "--lr", "5e-3", "--rank", "4"]
    r = kiln(daemon.home, "train", "opd", *common, "--adapter", "pupil", "--teacher", daemon.http + "/v1",
             "--eval-file", str(held), "--follow", "--json", timeout=600)
    assert r.returncode == 0, r.stderr + r.stdout
    job = json.loads(r.stdout.strip().splitlines()[-1])
    assert job["state"] == "completed" and job["total_steps"] == 4, job
    assert job["spec"]["teacher"] == daemon.http + "/v1" and job["spec"]["method"] == "opd"
    for k in ("held_out_kl_before", "held_out_kl_after"):
        assert job[k]["measure"] == "sampled" and job[k]["tokens"] > 0, job
    assert np.isfinite(job["kl"]) and job["sampled_tokens"] > 0
    meta = json.loads(kiln(daemon.home, "adapters", "list", "--json").stdout)["adapters"]
    pupil = [a for a in meta if a["name"] == "pupil"][0]
    assert pupil["method"] == "opd" and pupil["base_model"] == student_path.name
    # a teacher that is not there, or not an http URL, is refused before anything is queued
    for teacher, said in ((f"http://127.0.0.1:1/v1", "cannot be reached"), ("no-such-model", "teacher")):
        r = kiln(daemon.home, "train", "opd", *common, "--adapter", "pupil2", "--teacher", teacher, timeout=300)
        assert r.returncode != 0 and said in (r.stderr + r.stdout), (r.stderr, r.stdout)
    status, body = http(daemon, "POST", "/v1/train/opd", {"data": train.read_text(), "adapter": "x"})
    assert status == 400 and body["error"]["param"] == "teacher"
    status, body = http(daemon, "POST", "/v1/train/sft", {"data": train.read_text(), "adapter": "x", "teacher": "y"})
    assert status == 400 and "unknown field" in body["error"]["message"]
    # a field a method has no use for is refused, not ignored (the bus takes what the CLI never sends)
    from kiln.supervisor.bus.client import CommandFailed
    with daemon.client() as c, pytest.raises(CommandFailed, match="eval_file holds OPD's held-out prompts"):
        list(c.stream("train.submit", {"file": str(train), "adapter": "x", "method": "sft", "eval_file": str(held)},
                      timeout=60))
    kiln(daemon.home, "adapters", "delete", "pupil")
