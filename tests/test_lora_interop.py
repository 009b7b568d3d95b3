"""Adapters llama.cpp loads: our GGUF LoRA on the default model, against llama.cpp's logits.

tests/data/lora_llamacpp.json/.npz were made by llama.cpp (llama-cpp-python 0.3.36, see
tests/tools/llama_lora_reference.py) from the adapter `interop_adapter` builds — seeded, rank
16 on all seven targets, B ~ N(0, 0.02) so that it moves the model's top-1 token at several
confident positions (stronger ones push llama.cpp's own noise past the bars too).
The test rebuilds it (numpy's Generator is the same everywhere), checks its tensor-data hash
against the one llama.cpp loaded, and holds Kiln's adapter-applied logits to the engine bars.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from conftest import DATA
from fidelity import assert_meets_bars, measure
from kiln.native.lora import LoraConfig, init_adapter, load_adapter, save_adapter


def interop_adapter(model):
    rng = np.random.default_rng(2026)
    ad = init_adapter(model, LoraConfig(), rng)
    for _, b in ad.tensors.values():
        b[...] = rng.normal(0, 0.02, size=b.shape).astype(np.float32)
    return ad


def tensor_hash(ad) -> str:
    h = hashlib.sha256()
    for n, (a, b) in ad.tensors.items():
        h.update(n.encode() + a.tobytes() + b.tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def reference():
    return json.loads((DATA / "lora_llamacpp.json").read_text()), dict(np.load(DATA / "lora_llamacpp.npz"))


def test_gguf_round_trip_keeps_every_bit(default_model, tmp_path):
    ad = interop_adapter(default_model)
    path = save_adapter(ad, tmp_path / "a.gguf", "interop")
    back = load_adapter(path)
    assert back.arch == "llama" and back.alpha == 32.0 and back.rank == 16 and back.scale == 2.0
    assert tensor_hash(back) == tensor_hash(ad)
    from kiln.native.gguf_file import read_gguf
    g = read_gguf(path)
    assert g.metadata["general.type"] == "adapter" and g.metadata["adapter.type"] == "lora"
    assert g.tensor("blk.0.attn_q.weight.lora_a").shape == (16, 576)
    assert g.tensor("blk.0.ffn_down.weight.lora_b").shape == (576, 16)


@pytest.mark.slow
def test_llama_cpp_logits_with_our_adapter_meet_the_engine_bars(default_model, reference):
    ref, npz = reference
    ad = interop_adapter(default_model)
    assert tensor_hash(ad) == ref["adapter_tensor_sha256"], "the seeded adapter changed; rebuild the fixture"

    class WithAdapter:                       # the model, as fidelity.measure drives it, plus the LoRA
        def __init__(self, m):
            self.m = m

        def new_cache(self, n):
            return self.m.new_cache(n)

        def forward(self, tokens, cache, **kw):
            return self.m.forward(tokens, cache, adapter=ad, **kw)

    assert_meets_bars(measure(WithAdapter(default_model), ref, npz), "SmolLM2 + LoRA")
    # and the adapter matters: without it, the top-1 token differs from llama.cpp's adapted one
    # at several confident positions (7 of 147 when the fixture was made)
    flips = 0
    for p in ref["prompts"]:
        logits = default_model.forward(p["ids"], default_model.new_cache(len(p["ids"])), all_logits=True)
        flips += sum(int(np.argmax(row) != pos["top_ids"][0])
                     for row, pos in zip(logits, p["positions"]) if pos["margin"] > 0.25)
    assert flips >= 5
