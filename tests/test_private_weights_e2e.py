"""weights = "private" through a real daemon: `kiln up --model M --weights private` and a
moe-stream worker that copies all but its experts answer as the mapped engine does, and say
what they hold; a bad value fails where it was given, with the choices."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from daemon_harness import Daemon, env_for, http_json, kiln
from kiln.native import kernels
from kiln.native.experts.store import expert_map
from kiln.native.gguf_file import read_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled", reason="needs the compiled kernels")]

PROMPT = "Once upon a time"


def engine_text(path, home) -> str:
    """The mapped engine's greedy answer (`kiln debug generate`, its own process)."""
    r = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "debug", "generate", str(path), PROMPT,
                        "--max-tokens", "12", "--json"], capture_output=True, text=True, env=env_for(home), check=True)
    return json.loads(r.stdout)["text"]


def served_text(d) -> str:
    status, body = http_json(d, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def ready_worker(d) -> dict:
    return d.wait(lambda st: next((w for w in st["workers"] if w["name"] == "default" and w["worker_state"] == "ready"
                                   and w["stats"].get("weights")), None), timeout=90, what="default ready")


def test_kiln_up_with_private_weights_answers_as_the_mapped_engine(default_model_path, tmp_path):
    expected = engine_text(default_model_path, tmp_path)
    with Daemon(tmp_path, {}, extra_args=("--model", str(default_model_path), "--weights", "private")) as d:
        w = ready_worker(d)
        assert served_text(d) == expected
        g = read_gguf(default_model_path, skip_arrays=True)
        weights = w["stats"]["weights"]
        assert weights["mode"] == "private" and weights["tensors"] == len(g.tensors)
        assert weights["bytes"] == sum(t.n_bytes for t in g.tensors.values())
        assert weights["huge_page_bytes"] is not None and weights["copy_seconds"] >= 0
        assert [m["weights"] for m in d.command("ps")["models"]] == ["private"]
        assert "private" in kiln(tmp_path, "ps").stdout.splitlines()[-1]


def test_a_streamed_model_copies_all_but_its_experts(e8k2_path, tmp_path):
    expected = engine_text(e8k2_path, tmp_path)
    spec = {"kind": "moe-stream", "model": str(e8k2_path), "settings": {"expert_cache": "16MiB", "weights": "private"}}
    with Daemon(tmp_path, {"default": spec}) as d:
        w = ready_worker(d)
        assert served_text(d) == expected
        g = read_gguf(e8k2_path, skip_arrays=True)
        experts = {s.name for s in expert_map(g).values()}
        weights = w["stats"]["weights"]
        assert weights["mode"] == "private" and weights["tensors"] == len(g.tensors) - len(experts)
        assert weights["bytes"] == w["stats"]["memory"]["non_expert_bytes"]


def test_a_bad_weights_value_fails_where_it_was_given(default_model_path, tmp_path):
    r = kiln(tmp_path, "up", "--model", str(default_model_path), "--weights", "shared")
    assert r.returncode == 2 and "--weights 'shared': must be mapped or private" in r.stderr
    r = kiln(tmp_path, "up", "--weights", "private")
    assert r.returncode == 2 and "--weights needs --model" in r.stderr
    spec = {"kind": "inference", "model": str(default_model_path), "settings": {"weights": "shared"}}
    with Daemon(tmp_path, {"default": spec}) as d:
        w = d.wait_state("default", "fatal", timeout=60)
        assert "weights = 'shared' is not valid: mapped" in w["reason"] and w["restarts"] == 0
