"""The architecture registry (fast tier): every family is listed, inspect names each tiny model's
family and facts, a missing tensor is an error naming it, an unknown architecture lists the
supported ones."""

from __future__ import annotations

import pytest

from conftest import TINY_ARCHS, tiny_path
from kiln.native.arch import FAMILIES, family
from kiln.native.gguf_file import GGUFError
from kiln.native.models.inspect import inspect_model
from kiln.native.model import load_model

FAMILY_OF = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2moe",
             "qwen3moe": "qwen3moe", "olmoe": "olmoe", "phi3": "phi3", "gemma3": "gemma3",
             "qwen35": "qwen35", "qwen35moe": "qwen35moe", "gpt-oss": "gpt-oss", "smollm3": "smollm3",
             "ernie4_5": "ernie4_5", "ernie4_5-moe": "ernie4_5-moe", "lfm2": "lfm2", "deepseek2": "deepseek2",
             "deepseek2-v3": "deepseek2", "deepseek2-wide": "deepseek2"}


def test_the_registry_lists_every_family_with_what_it_needed():
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "phi3", "gemma3", "qwen35",
            "qwen35moe", "gpt-oss", "smollm3", "ernie4_5", "ernie4_5-moe", "lfm2", "deepseek2"} <= set(FAMILIES)
    assert all(f.notes for f in FAMILIES.values())
    assert family("mistral") is family("llama")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_inspect_names_the_family(arch):
    info = inspect_model(tiny_path(arch))
    assert info["family"]["name"] == FAMILY_OF[arch] and info["family"]["needs"]


def test_gemma3_facts_count_its_sliding_layers():
    f = inspect_model(tiny_path("gemma3"))["family"]
    assert f["sliding_window"] == 16 and f["sliding_layers"] == 5 and f["global_layers"] == 1
    assert f["rope_base_swa"] == 10000.0


def test_an_unknown_architecture_lists_the_supported_ones(tmp_path):
    from gguf import GGUFWriter
    path = tmp_path / "x.gguf"
    w = GGUFWriter(str(path), "mamba9")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match="'mamba9' is not supported.*gemma3"):
        load_model(path)


def test_a_missing_tensor_is_named(tmp_path):
    """A phi3 file whose fused qkv of layer 1 is renamed (same length, in the header's bytes):
    the error names the tensor the family needs."""
    data = tiny_path("phi3").read_bytes()
    assert data.count(b"blk.1.attn_qkv.weight") == 1
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data.replace(b"blk.1.attn_qkv.weight", b"blk.1.attn_qkx.weight"))
    with pytest.raises(GGUFError, match="blk.1.attn_qkv.weight"):
        load_model(broken)


def test_qwen35_facts_give_its_recurrent_state():
    f = inspect_model(tiny_path("qwen35"))["family"]
    assert f["recurrent_layers"] == 6 and f["attention_layers"] == 2
    # per sequence: conv (3 x 256) + delta-net state (4 heads x 32 x 32), float32, for 6 layers
    assert f["recurrent_state_bytes"] == 6 * 4 * (3 * 256 + 4 * 32 * 32)


def test_a_recurrent_cache_reuses_only_an_exact_extension():
    m = load_model(tiny_path("qwen35"))
    cache = m.new_cache(64)
    m.forward([5, 6, 7, 8], cache)
    assert cache.common_prefix([5, 6, 7, 8, 9]) == 4          # extends what is cached
    assert cache.common_prefix([5, 6, 7]) == 0                 # would need the state at 3: start over
    assert cache.common_prefix([5, 6, 9, 9, 9]) == 0
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.truncate(2)
    cache.truncate(0)
    assert cache.n == 0 and not cache._states


def test_gpt_oss_facts_and_mxfp4_bytes():
    info = inspect_model(tiny_path("gpt-oss"))
    f = info["family"]
    assert f["sliding_window"] == 32 and f["sliding_layers"] == 2 and f["rope_scaling"] == "yarn" and f["rope_factor"] == 32
    assert info["tensor_types"]["MXFP4"] == 12 and not info["unsupported_tensor_types"]


def test_the_compiled_mxfp4_product_is_the_numpy_paths():
    """An MXFP4 expert matrix times Q8_0-quantized activations: the AVX2 kernel against the
    dequantized matrix (gguf's reference) with the same activation rounding."""
    import numpy as np
    from kiln.native import kernels
    if kernels.compiled_module() is None:
        pytest.skip("the compiled extension is not built")
    m = load_model(tiny_path("gpt-oss"))
    w = m.layers[1].ffn.down_exps.expert(5)
    x = np.random.default_rng(3).standard_normal((5, w.shape[1])).astype(np.float32)
    compiled = kernels.matmul(x, w)
    previous = kernels.use_compiled(False)
    try:
        reference = kernels.matmul(x, w)
    finally:
        kernels.use_compiled(previous)
    assert np.allclose(compiled, reference, rtol=1e-5, atol=1e-5)


def test_plan_counts_only_the_layers_that_keep_keys_and_the_recurrent_state():
    from kiln.native.models.plan import plan
    dense = plan(tiny_path("llama"), ctx=1024, available=2**40, parallel=1)
    hybrid = plan(tiny_path("qwen35"), ctx=1024, available=2**40, parallel=1)
    assert dense["kv_cache_bytes"] == 2 * 2 * 2 * 32 * 2 * 1024            # 2 layers, K and V, 2 heads of 32, fp16
    state = 6 * 4 * (3 * 256 + 4 * 32 * 32)
    assert hybrid["recurrent_state_bytes"] == 3 * state         # the live states and two checkpoints
    assert hybrid["kv_cache_bytes"] == 2 * 2 * 2 * 64 * 2 * 1024 + hybrid["recurrent_state_bytes"]   # 2 attention layers
    m = load_model(tiny_path("qwen35"))
    cache = m.new_cache(64)
    m.forward(list(range(5, 25)), cache)
    assert cache.nbytes == 2 * 2 * 2 * 64 * 2 * 64 + state
    cache.checkpoint()                                          # a prompt's end: its states kept
    assert cache.nbytes == 2 * 2 * 2 * 64 * 2 * 64 + 2 * state


def test_sliding_window_layers_hold_only_their_window_and_compute_the_same_bits():
    """gemma3's five local layers (window 16) keep at most window + a chunk of keys however long
    the sequence, and dropping whole groups of 8 old positions leaves every logit's bits as they
    were: a 400-token sequence run at once equals the same run in chunks and single steps."""
    import numpy as np
    m = load_model(tiny_path("gemma3"))
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 280, 400)]
    whole = m.forward(ids, m.new_cache(512), all_logits=True)
    cache = m.new_cache(512)
    parts = [m.forward(ids[:100], cache, all_logits=True), m.forward(ids[100:356], cache, all_logits=True)]
    parts += [m.forward([t], cache)[None] for t in ids[356:]]
    assert np.array_equal(np.concatenate(parts), whole)
    held = max(len(k) for k in cache._wk.values())       # the window (+ up to 7 of its group) + a chunk
    assert len(cache._wk) == 5 and held <= 16 + 8 + 256
    from kiln.native.models.plan import plan
    p = plan(tiny_path("gemma3"), ctx=4096, available=2**40, parallel=1)
    assert p["kv_cache_bytes"] == 2 * 1 * 2 * 64 * 2 * 4096 + 2 * 5 * 2 * 64 * 2 * (16 + 256)


def test_inspect_says_only_what_the_file_is(default_model_path, e8k2_path):
    """SmolLM2 is a plain llama: neither Llama 3.1's rope factors nor a Mixtral (issue 42)."""
    from conftest import tiny_path
    from kiln.native.models.inspect import inspect_model
    smol = inspect_model(default_model_path)["family"]["needs"]
    assert "RMSNorm" in smol and "Llama 3.1" not in smol and "MoE" not in smol, smol
    assert "Mixtral-style MoE" in inspect_model(e8k2_path)["family"]["needs"]
    assert "rope_freqs factors" in inspect_model(tiny_path("llama3"))["family"]["needs"]


def test_the_default_context_is_the_largest_the_memory_budget_holds(default_model_path):
    """As Ollama sizes it by memory (issue 38): the trained context (SmolLM2: 8,192) when its KV
    cache for every parallel sequence fits the budget beside the weights, else the largest step
    that does; without a budget, the trained context up to 4,096."""
    from kiln.native.models.plan import plan
    roomy = plan(default_model_path, budget=64 * 2**30)
    assert (roomy["context"], roomy["context_why"]) == (8192, "trained")
    at_4k = plan(default_model_path, 4096)
    tight = plan(default_model_path, budget=at_4k["total_bytes"] + 1)
    assert tight["context"] == 4096 and "8,192 trained" in tight["context_why"] and "budget" in tight["context_why"]
    assert tight["total_bytes"] <= at_4k["total_bytes"] + 1
    plain = plan(default_model_path)
    assert plain["context"] == 4096 and "no memory budget" in plain["context_why"]
    assert plan(default_model_path, 2048)["context_why"] == "configured"


def test_an_ernie_variant_kiln_does_not_run_is_refused_naming_the_tensor(tmp_path):
    """ERNIE 4.5's loader allows an attention output bias; Kiln's llama skeleton has none, so a
    file with one is refused by name rather than run without it."""
    import numpy as np

    from gguf_copy import copy_gguf
    out = copy_gguf(tiny_path("ernie4_5"), tmp_path / "biased.gguf", add={"blk.1.attn_output.bias": np.zeros(128, np.float32)})
    with pytest.raises(GGUFError, match=r"blk\.1\.attn_output\.bias"):
        load_model(out)


@pytest.mark.parametrize("meta, message", [
    ({"ernie4_5-moe.expert_weights_scale": 1.5}, "expert_weights_scale = 1.5: llama.cpp does not scale"),
    ({"ernie4_5-moe.interleave_moe_layer_step": 2}, "interleave_moe_layer_step = 2: llama.cpp runs only 1"),
    ({"ernie4_5-moe.leading_dense_block_count": 9}, "leading_dense_block_count = 9"),
])
def test_an_ernie_moe_file_llama_cpp_would_run_otherwise_is_refused(tmp_path, meta, message):
    """What llama.cpp reads differently from what the file says (a weight scale it ignores, an
    interleave it cannot build) is refused by name, not run to another answer."""
    from gguf_copy import copy_gguf
    out = copy_gguf(tiny_path("ernie4_5-moe"), tmp_path / "odd.gguf", meta=meta)
    with pytest.raises(GGUFError, match=message):
        load_model(out)


@pytest.mark.parametrize("meta, message", [
    ({"lfm2.attention.head_count_kv": [0, 2, 0]}, r"head_count_kv = \[0, 2, 0\]: must be 4 counts"),
    ({"lfm2.attention.head_count_kv": [0, 2, 0, 1]}, "share one key-head count"),
    ({"lfm2.attention.head_count_kv": [0, 0, 0, 0]}, "share one key-head count, and there must be one"),
    ({"lfm2.shortconv.l_cache": 1}, "shortconv.l_cache = 1"),
])
def test_an_lfm2_file_with_a_bad_layer_plan_is_refused_naming_the_key(tmp_path, meta, message):
    from gguf_copy import copy_gguf
    out = copy_gguf(tiny_path("lfm2"), tmp_path / "odd.gguf", meta=meta)
    with pytest.raises(GGUFError, match=message):
        load_model(out)


def test_per_layer_key_heads_are_refused_for_a_family_that_has_one_count(tmp_path):
    from gguf_copy import copy_gguf
    out = copy_gguf(tiny_path("llama"), tmp_path / "odd.gguf", meta={"llama.attention.head_count_kv": [2, 2]})
    with pytest.raises(GGUFError, match="a llama model has one key-head count, not one per layer"):
        load_model(out)


@pytest.mark.parametrize("meta, drop, message", [
    ({"deepseek2.attention.head_count_kv": 4}, (), "head_count_kv = 4: must be 1"),
    ({"deepseek2.attention.key_length": 64}, (), "key_length = 64: must be kv_lora_rank"),
    ({"deepseek2.rope.scaling.yarn_beta_fast": 16.0}, (), "llama.cpp does not read YaRN's betas"),
    ({"deepseek2.expert_group_count": 3, "deepseek2.expert_group_used_count": 1}, (), "must divide expert_count"),
    ({}, ("blk.0.attn_k_b.weight",), "attn_k_b"),
])
def test_a_deepseek2_file_llama_cpp_would_run_otherwise_is_refused(tmp_path, meta, drop, message):
    from gguf_copy import copy_gguf
    out = copy_gguf(tiny_path("deepseek2"), tmp_path / "odd.gguf", meta=meta, drop=drop)
    with pytest.raises(GGUFError, match=message):
        load_model(out)


def test_a_deepseek2_file_of_the_legacy_layout_says_to_convert_it_again(tmp_path):
    import numpy as np
    from gguf_copy import copy_gguf
    drop = [f"blk.{i}.attn_{t}_b.weight" for i in (0, 1) for t in ("k", "v")]
    add = {f"blk.{i}.attn_kv_b.weight": np.zeros((4 * 48, 64), np.float32) for i in (0, 1)}
    out = copy_gguf(tiny_path("deepseek2"), tmp_path / "legacy.gguf", drop=drop, add=add,
                    drop_keys=("deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla"))
    with pytest.raises(GGUFError, match="legacy layout .attn_kv_b.* re-convert"):
        load_model(out)
