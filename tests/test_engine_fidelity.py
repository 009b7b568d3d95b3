"""The engine against llama.cpp's own outputs for the same files (tests/data/README.md)."""

import numpy as np
import pytest

from conftest import BITS_ARCHS, TINY_ARCHS, reference, tiny_path
from fidelity import assert_meets_bars, measure
from kiln.native import kernels
from kiln.native.model import load_model


@pytest.fixture(params=["compiled", "numpy"])
def kernel_path(request):
    """Both paths must meet the bars: the compiled kernels, and numpy (KILN_NATIVE_KERNELS=0)."""
    if request.param == "compiled" and not kernels.COMPILED_TYPES:
        pytest.skip("the compiled extension is not built")
    previous = kernels.use_compiled(request.param == "compiled")
    yield request.param
    kernels.use_compiled(previous)


def _cases(pairs, slow: set) -> list:
    """(model, kernel path) pairs as params, the `slow` ones marked so (the whole suite runs them)."""
    return [pytest.param(m, k, id=f"{k}-{m}" if "/" not in m else f"{m.split('/')[-1]}-{k}",
                         marks=pytest.mark.slow if (m, k) in slow else ()) for m, k in pairs]


# deepseek2-wide is there for the compiled attention at DeepSeek's 576-value rows; its numpy path
# (4-5 s a test) is tiny-deepseek2's numpy path at another width
NOT_NUMPY = {"deepseek2-wide", "tiny/tiny-deepseek2-wide"}
TINY_CASES = [(a, k) for a in TINY_ARCHS + ["llama-Q4_K_M", "llama-Q5_K_M", "llama-Q6_K", "llama-F16"]
              for k in ("compiled", "numpy") if not (k == "numpy" and a in NOT_NUMPY)]


# numpy of the newer families (2-3 s each there) with the whole suite: their compiled path and
# the older families' numpy path stay in the fast tier
SLOW_NUMPY = {("gemma3", "numpy"), ("gpt-oss", "numpy"), ("qwen35", "numpy"), ("qwen35moe", "numpy")}


@pytest.mark.parametrize(("arch", "kernel_path"), _cases(TINY_CASES, SLOW_NUMPY), indirect=["kernel_path"])
def test_tiny_model_matches_llama_cpp(arch, kernel_path):
    ref, npz = reference(f"tiny/tiny-{arch}")
    model = load_model(tiny_path(arch))
    # numpy: not tiny-llama3's 1,585-token prompt (14 s of ggml-exact attention there), whose
    # logits test_prompt_logits_are_llama_cpps_bits checks to the bit on that path
    short = {"max_prompt": 240} if kernel_path == "numpy" and arch == "llama3" else {}
    assert_meets_bars(measure(model, ref, npz, **short), f"tiny-{arch} ({kernel_path})")


@pytest.mark.slow
def test_default_model_matches_llama_cpp(default_model, default_model_path, kernel_path):
    ref, npz = reference("smollm2")
    model = default_model if kernel_path == "compiled" else load_model(default_model_path)
    assert_meets_bars(measure(model, ref, npz, **_numpy_share(kernel_path)), f"SmolLM2 ({kernel_path})")


def _numpy_share(kernel_path: str) -> dict:
    """The numpy path checks the prompts of up to 5 tokens (1 of 4) and 4 greedy tokens (everything
    takes it 50 s a model, this 3 s; its bits are held on the tiny models); the compiled path
    checks everything."""
    return {"max_greedy": 4, "max_prompt": 5} if kernel_path == "numpy" else {}


@pytest.mark.slow
def test_e8k8_variant_gives_the_dense_logits(default_model, e8k8_path):
    """Uniform routing over 8 scaled experts is the dense FFN. Checked in exact float32 (float32
    K/V too, where fp16 rounding would amplify the same differences): with
    ggml-style activation rounding, a 1e-7 summation-order difference flips a Q8 rounding and
    the difference grows chaotically (0.5–2.2 logits, like llama.cpp's own 1.15)."""
    moe = load_model(e8k8_path)
    ref, _ = reference("smollm2")
    previous = kernels.set_activation_quantization("none")
    compiled = kernels.use_compiled(False)
    try:
        for p in ref["prompts"]:
            dense = default_model.forward(p["ids"], default_model.new_cache(dtype=np.float32), all_logits=True)
            routed = moe.forward(p["ids"], moe.new_cache(dtype=np.float32), all_logits=True)
            assert np.abs(dense - routed).max() <= 1e-2
    finally:
        kernels.set_activation_quantization(previous)
        kernels.use_compiled(compiled)


@pytest.mark.slow
def test_e8k2_variant_matches_llama_cpp(e8k2_path, kernel_path):
    """E8K2 routes on near-ties (router top-2/top-3 gaps of ~1e-4 in probability), so it meets
    llama.cpp's bars only with llama.cpp's rounding: fp16 K/V with ggml's roundings around it,
    ggml's exp in the softmaxes and SiLU, its RoPE angles and sum orders. llama.cpp itself fails
    them with flash attention on (prompt 3: overlap 2.97, correlation 0.66;
    tests/tools/llama_self_agreement.py). The numpy path reproduces the same arithmetic
    (native/ggml_round.py)."""
    ref, npz = reference("smollm2-moe-e8k2")
    assert_meets_bars(measure(load_model(e8k2_path), ref, npz, **_numpy_share(kernel_path)), f"E8K2 ({kernel_path})")


KQUANT = [f"tiny/tiny-llama-{q}" for q in ("Q4_K_M", "Q5_K_M", "Q6_K", "F16")]   # tests/data/README.md
# the newer families' references remade here by llama.cpp built for AVX2/FMA/F16C (tests/data/README.md)
AVX2_REFS = ["tiny/avx2/tiny-llama3", "tiny/avx2/tiny-gemma3", "tiny/avx2/tiny-gpt-oss"]
MODELS = [f"tiny/tiny-{a}" for a in BITS_ARCHS] + AVX2_REFS + KQUANT + ["smollm2", "smollm2-moe-e8k2", "smollm2-moe-e8k8"]
MODEL_FIXTURE = {"smollm2": "default_model_path", "smollm2-moe-e8k2": "e8k2_path", "smollm2-moe-e8k8": "e8k8_path"}


# numpy: the tiny models only (the SmolLM2 files take a minute each there; K-quants and F16 are
# dequantized on that path, not multiplied in ggml's order)
BITS_CASES = [(m, "compiled") for m in MODELS] + \
    [(m, "numpy") for m in MODELS if m.startswith("tiny/") and m not in KQUANT and m not in NOT_NUMPY]


@pytest.mark.parametrize(("name", "kernel_path"), _cases(BITS_CASES, {
    ("tiny/avx2/tiny-llama3", "numpy"), ("tiny/avx2/tiny-gemma3", "numpy"), ("tiny/avx2/tiny-gpt-oss", "numpy"),
    ("smollm2-moe-e8k2", "compiled"), ("smollm2-moe-e8k8", "compiled")}), indirect=["kernel_path"])
def test_prompt_logits_are_llama_cpps_bits(name, kernel_path, request):
    """Beyond the bars: at every prompt position the top-20 logits are llama.cpp's float32 values
    exactly. What it takes is in tests/data/README.md — down to the C library's cosf for the
    RoPE table and the product gcc fuses when ggml rotates a pair."""
    if kernel_path == "compiled" and not kernels.compiled_module().features()["avx2_fma"]:
        pytest.skip("llama.cpp's bits are its AVX2 kernels' bits")
    path = tiny_path(name.split("tiny-")[1]) if name.startswith("tiny/") else request.getfixturevalue(MODEL_FIXTURE[name])
    ref, _ = reference(name)
    model = load_model(path)
    # the numpy path's ggml-exact attention is quadratic in numpy: a long prompt's first 512
    # positions (a causal model's logits there do not depend on what follows)
    cut = 512 if kernel_path == "numpy" else None
    for i, p in enumerate(ref["prompts"]):
        logits = model.forward(p["ids"][:cut], model.new_cache(len(p["ids"]) + 1), all_logits=True)
        for j, (row, pos) in enumerate(zip(logits, p["positions"])):
            want = np.array(pos["top_logits"], np.float32)
            assert np.array_equal(row[pos["top_ids"]], want), \
                f"{name} prompt {i} position {j}: max |Δ| {np.abs(row[pos['top_ids']] - want).max():.3g}"


@pytest.mark.parametrize("name", KQUANT[:3])
def test_k_quant_decode_steps_are_the_prompts_bits(name):
    """A decode step multiplies one row (K-quant weight rows taken in pairs), a prompt many (four
    rows per weight block, in L1-sized tiles): every row's arithmetic is the one-row kernel's, so a
    prompt fed one token at a time gives the batched prompt's logits bit for bit."""
    model = load_model(tiny_path(name.split("tiny-")[1]))
    ids = reference(name)[0]["prompts"][-1]["ids"][:24]
    whole = model.forward(ids, model.new_cache(len(ids) + 1), all_logits=True)
    cache = model.new_cache(len(ids) + 1)
    steps = np.stack([model.forward([i], cache) for i in ids])
    assert np.array_equal(whole, steps), f"max |Δ| {np.abs(whole - steps).max():.3g}"


@pytest.mark.parametrize("kernel_path", ["compiled", "numpy"], indirect=True)
@pytest.mark.parametrize(("tag", "n_ctx"), [("long", 2048), ("short", 512)])
def test_phi3_longrope_factors_follow_the_context_as_llama_cpp(tag, n_ctx, kernel_path):
    """Phi-3 128k files: `rope_factors_long` past the original context (1024 in this file),
    `rope_factors_short` below it, cos/sin scaled by rope.scaling.attn_factor — llama.cpp's bits
    at both context sizes (tests/tools/make_phi3_longrope.py; the two references' top-1 differ
    at 85 of 293 positions, so choosing the wrong set fails)."""
    if kernel_path == "compiled" and not kernels.compiled_module().features()["avx2_fma"]:
        pytest.skip("llama.cpp's bits are its AVX2 kernels' bits")
    ref, _ = reference(f"tiny/tiny-phi3-longrope-{tag}")
    assert ref["n_ctx"] == n_ctx
    model = load_model(tiny_path("phi3-longrope"))
    model.use_context(n_ctx)
    for i, p in enumerate(ref["prompts"]):
        logits = model.forward(p["ids"], model.new_cache(len(p["ids"]) + 1), all_logits=True)
        for j, (row, pos) in enumerate(zip(logits, p["positions"])):
            assert np.array_equal(row[pos["top_ids"]], np.array(pos["top_logits"], np.float32)), \
                f"{tag} prompt {i} position {j}"
