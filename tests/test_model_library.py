"""Finding models where users keep them, and planning whether they fit."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from conftest import tiny_path

pytestmark = pytest.mark.e2e      # starts a daemon (tests/test_layering.py checks)


def _kiln(env, *args):
    return subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """A model folder, a Hugging Face cache and an Ollama store, each with models in it."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_path("qwen3"), folder / "tiny-qwen3.gguf")
    (folder / "broken.gguf").write_bytes(b"this is not a model")
    (folder / "half.gguf").write_bytes(tiny_path("llama").read_bytes()[:100_000])     # interrupted download
    for i in (1, 2):                                  # a split model, as llama.cpp's gguf-split names it
        shutil.copy(tiny_path("olmoe"), folder / f"big-0000{i}-of-00002.gguf")
    hf = tmp_path / "hf" / "hub"
    snap = hf / "models--tiny-org--tiny-llama-GGUF" / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    blob = hf / "models--tiny-org--tiny-llama-GGUF" / "blobs" / "abc"
    blob.parent.mkdir(parents=True)
    shutil.copy(tiny_path("llama"), blob)
    (snap / "tiny-llama.Q8_0.gguf").symlink_to(blob)
    ollama = tmp_path / "ollama"
    data = tiny_path("qwen2").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / digest.replace(":", "-")).write_bytes(data)
    mf = ollama / "manifests" / "registry.ollama.ai" / "library" / "tinyqwen" / "latest"
    mf.parent.mkdir(parents=True)
    mf.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))
    env = dict(__import__("os").environ, KILN_MODEL_PATH=str(folder), HF_HUB_CACHE=str(hf), OLLAMA_MODELS=str(ollama))
    return env


def test_models_are_found_in_every_store_with_their_facts(stores):
    r = _kiln(stores, "models", "list", "--json")
    assert r.returncode == 0, r.stderr
    by_name = {e["name"]: e for e in json.loads(r.stdout)}
    q3 = by_name["tiny-qwen3"]
    assert (q3["source"], q3["architecture"], q3["quantization"], q3["context_length"]) == ("folder", "qwen3", "Q8_0", 2048)
    assert q3["parameters"] > 100_000
    hf = by_name["hf:tiny-org/tiny-llama-GGUF/tiny-llama.Q8_0.gguf@01234567"]
    assert hf["source"] == "hf-cache" and hf["architecture"] == "llama"
    assert by_name["ollama:tinyqwen:latest"]["architecture"] == "qwen2"
    split = by_name["big"]
    assert split["parts"] == 2 and split["file_bytes"] == 2 * tiny_path("olmoe").stat().st_size
    assert "not a GGUF" in by_name["broken"]["error"]
    assert "truncated" in by_name["half"]["error"]


def test_discovered_names_work_wherever_a_model_is_taken(stores):
    for name in ("ollama:tinyqwen:latest", "hf:tiny-org/tiny-llama-GGUF/tiny-llama.Q8_0.gguf@01234567", "tiny-qwen3"):
        r = _kiln(stores, "debug", "tokenize", name, "Hello there", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["ids"]


def test_human_listing_shows_unreadable_files_with_their_reason(stores):
    out = _kiln(stores, "models", "list").stdout
    assert "UNREADABLE" in out and "broken" in out and "tiny-qwen3" in out


def test_plan_says_fits_or_too_large_with_numbers(default_model_path):
    from kiln.native.models.plan import plan
    p = plan(default_model_path, ctx=2048)
    seq = 2 * 30 * 3 * 64 * 2 * 2048                                       # fp16 K and V of one sequence
    assert p["verdict"] == "fits" and p["weights_bytes"] > 90e6 and p["kv_per_sequence_bytes"] == seq
    assert p["parallel"] == 4 and p["kv_cache_bytes"] == 4 * seq           # each of `parallel` may fill the context
    small = plan(default_model_path, ctx=2048, available=150 * 2**20)
    assert small["verdict"] == "too_large" and "short" in small["advice"]
    # short by less than three sequences' KV: fewer parallel sequences would fit, and it says so
    need = p["total_bytes"] - seq - seq // 2
    fewer = plan(default_model_path, ctx=2048, available=int(need / 0.9))
    assert fewer["verdict"] == "too_large" and "2 parallel sequences instead of 4 (--parallel)" in fewer["advice"]
    assert plan(default_model_path, ctx=2048, available=int(need / 0.9), parallel=2)["verdict"] == "fits"
    moe = plan(tiny_path("olmoe"), ctx=512, available=300 * 2**20)
    assert moe["expert_bytes"] > 0


def test_plan_counts_a_draft_models_weights_and_its_kv_cache_per_sequence(default_model_path):
    from kiln.native.models.plan import plan
    draft = tiny_path("llama")
    alone, d = plan(default_model_path, ctx=2048), plan(draft, ctx=2048, parallel=1)
    both = plan(default_model_path, ctx=2048, draft=draft)
    assert both["draft_weights_bytes"] == d["weights_bytes"] > 0
    assert both["draft_kv_cache_bytes"] == 4 * d["kv_per_sequence_bytes"] > 0      # one per parallel sequence
    assert both["total_bytes"] == alone["total_bytes"] + both["draft_weights_bytes"] + both["draft_kv_cache_bytes"]
    tight = plan(default_model_path, ctx=2048, draft=draft, available=int(alone["total_bytes"] / 0.9) + 1)
    assert tight["verdict"] == "too_large" and "or no draft model" in tight["advice"]


def test_plan_is_within_15_percent_of_the_measured_rss(default_model_path):
    # The process's RSS, as `kiln ps` and the placer read it. The file is mapped once (header
    # parser and tensors share the mapping): with two, RSS counted the pages present in both
    # twice — 209 or 270 MiB from run to run for the same memory.
    code = f"""
import psutil
from pathlib import Path
from kiln.native.model import load_model
from kiln.native.generate import generate_text
from kiln.native.sampling import SamplingParams
path = Path({str(default_model_path)!r})
m = load_model(path)
ids = m.tokenizer.encode("Once upon a time " * 40)
generate_text(m, ids, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
maps = sum(1 for line in open("/proc/self/maps") if line.rstrip().endswith(str(path.resolve())))
print(maps, psutil.Process().memory_info().rss)
"""
    maps, rss = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                        check=True).stdout.split()[-2:])
    assert maps == 1
    from kiln.native.models.plan import plan
    p = plan(default_model_path, ctx=256)
    planned = p["total_bytes"] - p["prefix_cache_bytes"]          # a bare generation keeps no prefix cache
    assert 0 < p["prefix_cache_bytes"] <= 2 * p["kv_cache_bytes"] // p["parallel"]
    assert abs(planned - rss) / rss <= 0.15, (planned, rss)


def test_kiln_up_refuses_a_model_that_will_not_fit(default_model_path, tmp_path):
    from daemon_harness import env_for, write_config
    cfg = write_config(tmp_path, {"default": {"kind": "inference", "model": str(default_model_path)}},
                       supervisor={"memory_budget": 100 * 2**20})
    r = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "up", "--config", str(cfg)],
                       capture_output=True, text=True, env=env_for(tmp_path), timeout=60)
    assert r.returncode == 1
    assert "will not run here" in r.stderr and "GiB short" in r.stderr


def test_rm_refuses_a_model_a_running_worker_uses(tmp_path):
    from daemon_harness import Daemon, env_for
    (tmp_path / "models").mkdir()
    model = tmp_path / "models" / "tiny-qwen3.gguf"
    shutil.copy(tiny_path("qwen3"), model)
    with Daemon(tmp_path, {"tiny": {"kind": "inference", "model": str(model)}}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=60, what="loaded")
        env = env_for(tmp_path)
        r = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "models", "rm", "tiny-qwen3", "--yes"],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 1 and "in use by worker tiny" in r.stderr and model.exists()
        d.command("stop", {"name": "tiny"})
        d.wait_state("tiny", "stopped")
        r = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "models", "rm", "tiny-qwen3", "--yes"],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and not model.exists()


def test_inspect_and_plan_on_the_moe_variants(e8k8_path, e8k2_path):
    from kiln.native.models.inspect import inspect_model
    from kiln.native.models.plan import plan
    for path, k in ((e8k8_path, 8), (e8k2_path, 2)):
        info = inspect_model(path)
        assert info["moe"]["experts"] == 8 and info["moe"]["experts_used"] == k and info["moe"]["expert_bytes"] == 30 * 3 * 1536 * 576 * 20 // 32
        p = plan(path, ctx=1024)
        assert p["verdict"] == "fits" and p["expert_bytes"] == info["moe"]["expert_bytes"]
        room = p["non_expert_bytes"] + p["kv_cache_bytes"] + p["prefix_cache_bytes"] + p["runtime_bytes"] + 70 * p["expert_bytes"] // (30 * 8)
        tight = plan(path, ctx=1024, available=int(room / 0.9))          # 70 of the 240 experts fit
        assert tight["verdict"] == "streams" and tight["expert_cache_slots"] >= 2 * 30

