"""Shared fixtures: the default model and its MoE variants, fetched/built once into a cache
folder (KILN_TEST_CACHE, default <repo>/.cache/models) and reused by every test and run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))

from moe_variants import HASHES, build_variant, tensor_data_hash  # noqa: E402


def cache_dir() -> Path:
    d = Path(os.environ.get("KILN_TEST_CACHE") or HERE.parent / ".cache" / "models")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from kiln.native.models.library import pull_default
    return pull_default(cache_dir())


def _variant(default_model_path: Path, k: int) -> Path:
    out = cache_dir() / f"SmolLM2-135M-Instruct-MoE-E8K{k}.gguf"
    if not out.exists() or tensor_data_hash(out) != HASHES[k]:
        tmp = out.with_suffix(".tmp")
        build_variant(default_model_path, tmp, k, np.load(DATA / "moe_router_E8.npy") if k == 2 else None)
        assert tensor_data_hash(tmp) == HASHES[k], "MoE generator no longer byte-exact"
        os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def e8k8_path(default_model_path) -> Path:
    return _variant(default_model_path, 8)


@pytest.fixture(scope="session")
def e8k2_path(default_model_path) -> Path:
    return _variant(default_model_path, 2)


@pytest.fixture(scope="session")
def student_path(default_model_path) -> Path:
    """The default model's first two layers (its own embedding, head and tokenizer): a small
    student of the same vocabulary for distillation from the whole model."""
    from gguf import GGUFReader

    from gguf_copy import copy_gguf
    out = cache_dir() / "SmolLM2-135M-Instruct-2-layers.gguf"
    if not out.exists():
        r = GGUFReader(default_model_path)
        drop = [t.name for t in r.tensors if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= 2]
        del r
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        copy_gguf(default_model_path, tmp, meta={"llama.block_count": 2, "general.name": "SmolLM2 2 layers"},
                  drop=drop)
        os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def default_model(default_model_path):
    from kiln.native.model import load_model
    return load_model(default_model_path)


def reference(name: str) -> tuple[dict, dict]:
    """(json, npz) of a llama.cpp reference in tests/data ("smollm2", "tiny/tiny-qwen3", …)."""
    ref = json.loads((DATA / f"{name}.json").read_text())
    npz = np.load(DATA / f"{name}.npz")
    return ref, {k: npz[k] for k in npz.files}


TINY_ARCHS = ["llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "phi3", "llama3", "gemma3", "qwen35",
              "qwen35moe", "gpt-oss", "smollm3", "ernie4_5", "ernie4_5-moe", "lfm2", "deepseek2", "deepseek2-v3",
              "deepseek2-wide"]
# llama.cpp's float32 bits are reproduced at every prompt position for these (the others meet
# the fidelity bars; tests/data/README.md says where they part)
BITS_ARCHS = ["llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "phi3", "smollm3", "ernie4_5", "ernie4_5-moe", "lfm2",
              "deepseek2", "deepseek2-wide"]


def tiny_path(arch: str) -> Path:
    return DATA / "tiny" / f"tiny-{arch}.gguf"


@pytest.fixture(autouse=True)
def _isolated_kiln_home(tmp_path_factory, monkeypatch):
    """No test reads or writes the user's ~/.kiln, config or environment overrides."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path_factory.mktemp("kiln-home")))
    for k in list(os.environ):
        if k.startswith(("KILN_SERVER_", "KILN_SUPERVISOR_")) or k in ("KILN_CONFIG", "KILN_MODEL_PATH"):
            monkeypatch.delenv(k)


# -- tiers -------------------------------------------------------------------------------------
# `pytest -m "not e2e"` is the fast tier (≤ 2 min on 2 cores): no daemon, fake spawner and clock,
# small models. A module that starts `kiln up` says so itself (`pytestmark = pytest.mark.e2e`;
# tests/test_layering.py fails when one does not); a single slow test is marked `slow`, which is
# end-to-end too.


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium through playwright, one per module (tests/browser_harness.py)."""
    from browser_harness import launch
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()
