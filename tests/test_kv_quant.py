"""A KV cache in 8 and 4 bits (issue 38, item 1): ggml's q8_0/q4_0 blocks written as llama.cpp
writes them, read by the attention kernels directly, counted in the plan at their real size."""

import numpy as np
import pytest

from conftest import tiny_path
from kiln.native import kernels
from kiln.native.kv_cache import KVCache
from kiln.native.kv_types import KV_TYPE_NAMES, KVTypeError, decode, encode, kv_type
from kiln.native.model import load_model
from kiln.native.runners import blocks_runners
from kiln.supervisor.core.config import KV_TYPES, ConfigError, load_config

compiled = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled", reason="the compiled kernels")


def _rows(seed=0, shape=(7, 2, 64)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 30, shape[:-1] + (1,)).astype(np.float32)
    x[0, 0, :32] = 0                         # an all-zero block: scale 0, codes 0
    x[1, 1, 5] = 1e4                         # one outlier owns its block's scale
    return x


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "f16"])
def test_the_compiled_store_writes_the_numpy_codecs_bits_and_widens_them_back(name):
    t, x = kv_type(name), _rows()
    want = encode(t, x)
    got = np.empty_like(want)
    if kernels.compiled_module() is not None:
        kernels.kv_store(t, x, got)
        assert got.tobytes() == want.tobytes()
        assert np.array_equal(kernels.kv_widen(got), decode(want))
    back = decode(want)
    # a step: the block's largest value / 127 (q8_0) or / 8 (q4_0); off by at most half a step
    # (a whole one where q4_0's codes stop at +7), plus what the fp16 scale's rounding moves
    blocks = lambda a: a.reshape(7, 2, 2, 32)  # noqa: E731
    if name == "f16":
        assert np.allclose(back, x, rtol=2 ** -11, atol=0)
    else:
        step = np.abs(blocks(x)).max(-1, keepdims=True) / (127 if name == "q8_0" else 8)
        assert (np.abs(blocks(back) - blocks(x)) <= step * (0.57 if name == "q8_0" else 1.01)).all()
    assert not back[0, 0, :32].any()


def test_the_types_say_their_size_and_refuse_what_does_not_fit():
    assert [kv_type(n).bytes_per_value for n in KV_TYPE_NAMES] == [2, 34 / 32, 18 / 32]
    assert KV_TYPE_NAMES == KV_TYPES                # the supervisor's copy (it does not import the engine)
    assert kv_type("Q8_0").name == "q8_0" and kv_type(np.float16).name == "f16"
    with pytest.raises(KVTypeError, match="'q5_1' is not one of f16, q8_0, q4_0"):
        kv_type("q5_1")
    with pytest.raises(KVTypeError, match="head_dim 48 is not a multiple of it"):
        KVCache(2, 2, 48, 64, "q8_0")
    f16, q8, q4 = (KVCache(2, 2, 64, 1024, t) for t in ("f16", "q8_0", "q4_0"))
    mixed = KVCache(2, 2, 64, 1024, "q8_0", v_dtype="f16")
    for c in (f16, q8, q4, mixed):
        c.begin([0] * 300)
    assert (q8.nbytes, q4.nbytes, mixed.nbytes) == (f16.nbytes * 34 // 64, f16.nbytes * 18 // 64,
                                                    f16.nbytes * (34 + 64) // 128)


@compiled
@pytest.mark.parametrize("kv", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16")], ids=["q8_0", "q4_0", "q8_0-f16"])
def test_a_quantized_cache_keeps_the_batch_invariance_and_one_call_decode_bits(kv, default_model):
    """However the prompt is batched, and through the one-call compiled layer or step by step,
    a quantized cache gives the same bits — each (row, head) reads the same blocks in the same
    order."""
    m = default_model
    ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it sleeps.")

    def chunks(sizes):
        c, i = m.new_cache(dtype=kv[0], v_dtype=kv[1]), 0
        for n in sizes:
            out = m.forward(ids[i:i + n], c, all_logits=True)
            i += n
        return out[-1]
    whole = chunks([len(ids)])
    assert np.array_equal(whole, chunks([1] * len(ids))) and np.array_equal(whole, chunks([5, 1, 7, len(ids) - 13]))

    prompts = [m.tokenizer.encode(t) for t in ("Once upon a time, in a land far away,", "The capital of France is")]

    def decode_steps():
        caches = [m.new_cache(dtype=kv[0], v_dtype=kv[1]) for _ in prompts]
        last = [m.forward(p, c) for p, c in zip(prompts, caches)]
        out = []
        for _ in range(4):
            last = list(m.forward_batch([int(np.argmax(x)) for x in last], caches))
            out.append(np.array(last))
        return np.concatenate(out)
    assert [r.kind for r in m.runners] == ["one call (dense)"] * len(m.layers)
    fused = decode_steps()
    saved, m.runners = m.runners, blocks_runners(m.layers)
    try:
        assert np.array_equal(fused, decode_steps())
    finally:
        m.runners = saved


@compiled
def test_the_compiled_attention_is_the_definition_over_the_blocks():
    """Scores: the query quantized to q8_0 (ggml's flash attention converts it to the key type's
    vec_dot_type) times the key blocks, in integers, scaled; softmax in float; values widened
    from their blocks — checked against that definition written in numpy."""
    rng = np.random.default_rng(3)
    T, S, H, Hkv, d = 3, 40, 4, 2, 64
    q = rng.standard_normal((T, H, d)).astype(np.float32)
    k, v = rng.standard_normal((2, S, Hkv, d)).astype(np.float32)
    for kt, vt in (("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_0", "q8_0")):
        kb, vb = encode(kv_type(kt), k), encode(kv_type(vt), v)
        got = kernels.attention_compiled(q, kb, vb, S - T)
        qq = decode(encode(kv_type("q8_0"), q))             # the query as its q8_0 blocks
        kw, vw = decode(kb), decode(vb)
        want = np.empty((T, H, d), np.float32)
        for t in range(T):
            n = S - T + t + 1
            for h in range(H):
                s = kw[:n, h // 2] @ qq[t, h] / np.sqrt(d)
                p = np.exp(s - s.max())
                want[t, h] = (p / p.sum()) @ vw[:n, h // 2]
        assert np.allclose(got.reshape(T, H, d), want, rtol=1e-4, atol=1e-5), (kt, vt)


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss", "qwen35"])
def test_sliding_window_sinks_and_recurrent_families_run_on_a_quantized_cache(arch):
    """A window layer's own buffers, attention sinks and a recurrent state beside a q8_0 cache:
    the logits follow the fp16 cache's."""
    m = load_model(tiny_path(arch))
    ids = list(range(3, 60))
    ref = m.forward(ids, m.new_cache(dtype="f16"), all_logits=True)
    got = m.forward(ids, m.new_cache(dtype="q8_0"), all_logits=True)
    assert np.corrcoef(ref[-1], got[-1])[0, 1] > 0.99


def test_the_plan_counts_the_real_bytes_and_a_budget_gives_a_quantized_cache_more_context(default_model_path):
    from kiln.native.models.plan import plan
    f16 = plan(default_model_path, 4096)
    q8 = plan(default_model_path, 4096, kv=("q8_0", "q8_0"))
    q4 = plan(default_model_path, 4096, kv=("q4_0", "q4_0"))
    assert q8["kv_cache_bytes"] == f16["kv_cache_bytes"] * 34 // 64 and q8["kv_types"] == ["q8_0", "q8_0"]
    assert q4["kv_cache_bytes"] == f16["kv_cache_bytes"] * 18 // 64
    # a budget where fp16 gets 4,096 positions: q4_0 gets the trained 8,192
    budget = f16["total_bytes"] + 1
    assert plan(default_model_path, budget=budget)["context"] == 4096
    assert plan(default_model_path, budget=budget, kv=("q4_0", "q4_0"))["context"] == 8192


def test_the_kv_type_is_configured_per_worker_for_every_model_and_by_ollamas_name(tmp_path):
    c = load_config(env={})
    assert c["models"]["kv_type"] == "f16" and "kv_type_k" not in c.workers["default"]["settings"]
    c = load_config(env={"OLLAMA_KV_CACHE_TYPE": "Q8_0"})
    assert (c["models"]["kv_type"], c.sources["models.kv_type"]) == ("q8_0", "env")
    assert c.workers["default"]["settings"] == {"kv_type_k": "q8_0", "kv_type_v": "q8_0"}
    c = load_config(env={"OLLAMA_KV_CACHE_TYPE": "q8_0", "KILN_MODELS_KV_TYPE": "q4_0"})
    assert c["models"]["kv_type"] == "q4_0"                  # Kiln's own name wins over the alias
    c = load_config(cli={"models.kv_type": "q4_0"}, env={})
    assert c.sources["models.kv_type"] == "cli" and c.workers["default"]["settings"]["kv_type_v"] == "q4_0"
    f = tmp_path / "kiln.toml"
    f.write_text("[models]\nkv_type = 'q8_0'\nkv_type_v = 'f16'\n"
                 "[workers.a]\nkind = 'inference'\n"
                 "[workers.b]\nkind = 'inference'\nsettings = { kv_type = 'q4_0' }\n")
    c = load_config(str(f), env={})
    assert c.workers["a"]["settings"] == {"kv_type_k": "q8_0", "kv_type_v": "f16"}
    assert c.workers["b"]["settings"] == {"kv_type": "q4_0"}            # its own wins
    for bad, match in ((f"[models]\nkv_type = 'q5_0'\n", "models.kv_type = 'q5_0' is not valid"),
                       ("[workers.a]\nkind = 'inference'\nsettings = { kv_type_k = 'fp8' }\n",
                        r"settings.kv_type_k = 'fp8' is not valid: must be one of f16, q8_0, q4_0")):
        f.write_text(bad)
        with pytest.raises(ConfigError, match=match):
            load_config(str(f), env={})
    with pytest.raises(ConfigError, match="OLLAMA_KV_CACHE_TYPE"):
        load_config(env={"OLLAMA_KV_CACHE_TYPE": "q4_1"})
