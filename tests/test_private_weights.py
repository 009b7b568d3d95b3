"""Weights copied into private huge pages (weights = "private"): the same bits as the mapped
file, the experts of a streamed model left in the mapping, and errors that say what failed."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from conftest import DATA
from kiln.native.experts.store import expert_map
from kiln.native.gguf_file import read_gguf
from kiln.native.model import load_model

TINY = DATA / "tiny"
PROMPT = [1, 15, 200, 42, 7, 99, 250, 5, 64, 12]


def _in_mapping(g, arr) -> bool:
    return g._map is not None and np.shares_memory(arr, g._map)


def test_private_weights_give_the_mapped_models_bits_and_hold_no_view_of_the_file():
    path = TINY / "tiny-llama.gguf"
    mapped = load_model(path)
    private = load_model(path, weights="private")
    g = private.gguf
    st = g.private.stats()
    assert st["tensors"] == len(g.tensors) and st["bytes"] == sum(t.n_bytes for t in g.tensors.values())
    for name in g.tensors:
        arr = g.raw(name)
        assert not _in_mapping(g, arr) and not arr.flags.writeable, name
        assert np.array_equal(arr, mapped.gguf.raw(name)), name
    a = mapped.forward(PROMPT, mapped.new_cache(), all_logits=True)
    b = private.forward(PROMPT, private.new_cache(), all_logits=True)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_a_streamed_models_experts_stay_in_the_mapping():
    path = TINY / "tiny-qwen2moe.gguf"
    experts = {s.name for s in expert_map(read_gguf(path, skip_arrays=True)).values()}
    assert experts
    m = load_model(path, weights="private", keep_mapped=experts)
    g = m.gguf
    assert set(g.private.arrays) == set(g.tensors) - experts
    assert g.private.stats()["bytes"] == sum(t.n_bytes for n, t in g.tensors.items() if n not in experts)
    for name in experts:
        assert _in_mapping(g, g.raw(name)), name
    ref = load_model(path)
    a = ref.forward(PROMPT, ref.new_cache(), all_logits=True)
    b = m.forward(PROMPT, m.new_cache(), all_logits=True)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_a_file_cut_short_while_copying_names_the_tensor(tmp_path):
    path = tmp_path / "cut.gguf"
    shutil.copyfile(TINY / "tiny-llama.gguf", path)
    g = read_gguf(path)
    last = max(g.tensors.values(), key=lambda t: t.offset)
    with open(path, "r+b") as f:
        f.truncate(last.offset + last.n_bytes // 2)
    with pytest.raises(OSError, match=f"tensor '{last.name}' ends early: {last.n_bytes // 2} of {last.n_bytes} bytes"):
        g.copy_to_private(g.tensors)


def test_an_unknown_weights_mode_is_refused_with_the_choices():
    from kiln.native.model import WEIGHTS
    from kiln.supervisor.core.config import WEIGHTS as CONFIG_WEIGHTS
    assert CONFIG_WEIGHTS == WEIGHTS                   # the CLI and the config check what the engine takes
    with pytest.raises(ValueError, match="weights = 'shared': must be one of mapped, private"):
        load_model(TINY / "tiny-llama.gguf", weights="shared")
