"""The compiled kernels against the numpy reference path, on random GGUF blocks of every type.

The reference is `gguf.quants.dequantize` + a numpy matmul of the activations rounded as ggml
rounds them for that weight type (kernels.py's numpy path), so what is compared is the kernel's
block arithmetic, AVX2 and portable alike; float weight types are compared to plain float32."""

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kiln.native import ggml_round, kernels
from kiln.native.blocks import route, softmax
from kiln.native.kernels import Weight

C = kernels.compiled_module()
pytestmark = pytest.mark.skipif(C is None, reason="the compiled extension is not built")

# byte offsets of each block's fp16 scale fields (d, and dmin/m where the type has one): random
# bytes are a valid block everywhere else, but a random fp16 may be inf or NaN
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
               Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def random_weight(qtype: Q, n_out: int, n_in: int, rng: np.random.Generator) -> Weight:
    if qtype in FLOAT_TYPES:
        w = rng.standard_normal((n_out, n_in)).astype(np.float32)
        if qtype == Q.F16:
            raw = w.astype(np.float16).view(np.uint8)
        elif qtype == Q.BF16:
            raw = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = w.view(np.uint8)
        return Weight(f"random {qtype.name}", qtype, (n_out, n_in), np.ascontiguousarray(raw.reshape(n_out, -1)))
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_out, n_in // block, size), dtype=np.uint8)
    if qtype == Q.MXFP4:                               # an E8M0 exponent byte: keep the scale sane
        blocks[:, :, 0] = rng.integers(118, 130, (n_out, n_in // block), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, ()):
        scale = (rng.uniform(0.2, 1.0, (n_out, n_in // block)) * rng.choice([-1, 1], (n_out, n_in // block)) / 64)
        blocks[:, :, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_out, n_in // block, 2)
    return Weight(f"random {qtype.name}", qtype, (n_out, n_in), blocks.reshape(n_out, -1))


def reference(x: np.ndarray, w: Weight) -> np.ndarray:
    """gguf.quants.dequantize + a numpy matmul, the activations rounded as ggml rounds them."""
    dense = dequantize(w.raw, w.qtype).reshape(w.shape).astype(np.float32)
    kind = kernels._ACT_QUANT.get(w.qtype)
    return kernels.quantize_activations(x, kind) @ dense.T


@pytest.fixture(params=["avx2", "portable"])
def simd(request):
    if request.param == "avx2" and not C.features()["avx2_fma"]:
        pytest.skip("this CPU has no AVX2/FMA")
    was = C.features()["avx2_fma"]
    C.set_simd(request.param == "avx2")
    yield request.param
    C.set_simd(was)


@pytest.mark.parametrize("qtype", sorted(kernels.COMPILED_TYPES, key=int), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 6, 13])      # one decode row; a tile of 4 and a remainder; 8 + 4 + 1
def test_every_type_equals_dequantize_and_numpy(qtype, rows, simd):
    rng = np.random.default_rng(int(qtype) * 10 + rows)
    n_in = 512                                         # two K-quant super-blocks
    w = random_weight(qtype, 40, n_in, rng)
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    got = kernels.matmul(x, w)
    want = reference(x, w)
    assert got.shape == want.shape == (rows, 40) and got.dtype == np.float32
    err = np.abs(got - want).max() / np.abs(want).max()
    bar = 1e-5 if qtype in FLOAT_TYPES else 1e-4       # the same rounding: only the sum order differs
    assert err <= bar, f"{qtype.name} ({simd}): relative error {err:.2e}"


@pytest.fixture(params=["avx512", "avx2"])
def kernel_width(request):
    """the K-quant multi-row kernels in AVX-512 VNNI (where the CPU has it), then in AVX2"""
    if request.param == "avx512" and not C.features()["avx512_vnni"]:
        pytest.skip("this CPU (or KILN_SIMD) has no AVX-512 VNNI")
    was = C.features()["avx512_vnni"]
    C.set_simd(True, request.param == "avx512")
    yield request.param
    C.set_simd(True, was)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.MXFP4],
                         ids=lambda t: t.name)
def test_a_row_is_the_same_bits_whichever_batch_or_call_computes_it(qtype, kernel_width):
    rng = np.random.default_rng(7)
    K = 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16) else 544   # two K-quant blocks; 17 of 32 (an odd last)
    w = random_weight(qtype, 64, K, rng)
    x = rng.standard_normal((17, K)).astype(np.float32)
    alone = np.concatenate([kernels.matmul(x[i:i + 1], w) for i in range(17)])
    for rows in range(2, 18):           # every multi-row kernel (2..8 rows), and 8s with each remainder
        together = kernels.matmul(x[:rows], w)
        assert np.array_equal(together, alone[:rows]), f"{qtype.name}: a batch of {rows} rows"
    many = kernels.matmul_many(x, [w, w])
    assert all(np.array_equal(alone, m) for m in many)
    # one row takes the weight rows in pairs: odd counts, and a pair that would straddle two weights
    odd = [random_weight(qtype, n, K, rng) for n in (7, 5, 3)]
    one, two = kernels.matmul_many(x[:1], odd), kernels.matmul_many(x[:2], odd)
    assert all(np.array_equal(a, b[:1]) for a, b in zip(one, two)), f"{qtype.name}: one row, odd weights"
    # a prompt takes weight rows two at a time too: a pair straddling two weights, an odd last row
    alone_odd = [np.concatenate(m) for m in zip(*(kernels.matmul_many(x[i:i + 1], odd) for i in range(17)))]
    assert all(np.array_equal(a, b) for a, b in zip(alone_odd, kernels.matmul_many(x, odd))), f"{qtype.name}: odd weights"


def test_compiled_routing_chooses_and_weighs_experts_as_the_softmax_does():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 64)).astype(np.float32)
    router = random_weight(Q.F32, 8, 64, rng)
    for k, normalize in [(2, False), (2, True), (8, True)]:
        experts, weights = route(x, router, k, normalize)
        probs = softmax(x @ router.dense.T)
        for t in range(50):
            want = np.argsort(-probs[t], kind="stable")[:k]
            order = np.argsort(want)
            assert experts[t].tolist() == sorted(want.tolist())          # ascending, as summed
            w = probs[t][want] / (probs[t][want].sum() if normalize else 1)
            np.testing.assert_allclose(weights[t], w[order], rtol=1e-5)


@pytest.mark.parametrize("rule", ["ernie", "softmax-groups", "sigmoid-groups-scaled", "sigmoid-unnormed"])
def test_the_compiled_routing_rule_is_the_numpy_rules_bits(rule):
    """ernie4.5-moe's and deepseek2's routing (a selection bias, sigmoid gating, groups kept by
    their two best scores, renormalised and scaled weights): the C rule that the blocks and the
    one-call decode share gives the numpy form's experts and weights bit for bit."""
    from kiln.native.arch.deepseek2 import SIGMOID, SOFTMAX, DeepSeekMoE
    from kiln.native.arch.ernie import ErnieMoE
    rng = np.random.default_rng(5)
    E, k, T = 64, 6, 40
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    logits[3, 10] = logits[3, 11]                                    # a tie: the lower index first
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    none = dict(router=None, gate_exps=None, up_exps=None, down_exps=None)
    moe, norm, scale = {
        "ernie": (ErnieMoE(**none, probs_b=bias), True, 0.0),
        "softmax-groups": (DeepSeekMoE(**none, gating=SOFTMAX, groups=8, groups_used=3, norm=True), True, 0.0),
        "sigmoid-groups-scaled": (DeepSeekMoE(**none, probs_b=bias, gating=SIGMOID, groups=8, groups_used=2, norm=True,
                                              scale=2.5), True, 2.5),
        "sigmoid-unnormed": (DeepSeekMoE(**none, probs_b=bias, gating=SIGMOID, norm=False, scale=16.0), False, 16.0)}[rule]
    probs = moe.probs(logits) if isinstance(moe, DeepSeekMoE) else ggml_round.softmax(logits)
    want_e, want_w = moe.choose(probs, k, norm, scale)
    experts, weights = np.empty((T, k), np.int32), np.empty((T, k), np.float32)
    C.route(logits, T, E, k, norm, experts, weights, moe.rule())
    assert np.array_equal(experts, want_e) and np.array_equal(weights, want_w)
    with pytest.raises(ValueError, match="groups"):                  # groups that cannot hold the k chosen
        C.route(logits, T, E, k, norm, experts, weights, (None, False, 32, 2, 0.0))
    with pytest.raises(ValueError, match="selection bias"):
        C.route(logits, T, E, k, norm, experts, weights, (bias[:-1], False, 0, 0, 0.0))


def test_bad_buffers_are_refused_not_read_past():
    w = random_weight(Q.Q4_0, 8, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="smaller than its shape"):
        C.matmul(np.zeros(64, np.float32), w.raw, int(Q.Q4_0), 1, 64, 9, np.zeros(9, np.float32), 0)
    with pytest.raises(ValueError, match="multiple of block"):
        C.matmul(np.zeros(60, np.float32), w.raw, int(Q.Q4_0), 1, 60, 8, np.zeros(8, np.float32), 0)
    with pytest.raises(ValueError, match="experts"):
        C.route(np.zeros(8, np.float32), 1, 8, 9, False, np.zeros(9, np.int32), np.zeros(9, np.float32))
    # the streamed FFN steps: one row of 64, k = 2 — a pointer table one expert short
    x, norm = np.zeros((1, 64), np.float32), np.ones(64, np.float32)
    sel, wsel, done = np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float32), np.zeros((1, 2), np.uint8)
    with pytest.raises(ValueError, match="moe_stream: a buffer is smaller than its shape"):
        C.moe_stream(x, norm, 1e-5, int(Q.Q4_0), int(Q.Q4_0), 32, sel, wsel, np.zeros((1, 1, 3), np.uint64), done,
                     np.zeros((1, 2, 64), np.float32), 0)
    assert C.moe_stream(x, norm, 1e-5, int(Q.Q4_0), int(Q.Q4_0), 32, sel, wsel, np.zeros((1, 2, 3), np.uint64),
                        done, np.zeros((1, 2, 64), np.float32), 0) == 2      # nothing resident: both left


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F32], ids=lambda t: t.name)
def test_the_numpy_path_computes_the_compiled_kernels_bits(qtype):
    """native/ggml_round.py reproduces the AVX2 kernels (and so ggml) exactly: products,
    attention over an fp16 cache, the softmax and SiLU — so both paths route an MoE alike."""
    if not C.features()["avx2_fma"]:
        pytest.skip("the portable kernels sum in another order")
    rng = np.random.default_rng(int(qtype))
    w = random_weight(qtype, 48, 576, rng)
    x = rng.standard_normal((7, 576)).astype(np.float32)
    # activation quantization's edges: an all-zero block; a block whose largest value is 127, so
    # the values are their own quantized products — halves round to even; a lone huge value
    x[5, :32] = 0
    x[5, 32:64] = np.r_[127, -127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, np.arange(22) - 11.5]
    x[6, 64:96] = 1e-3
    x[6, 70] = 3e4
    assert np.array_equal(kernels.matmul(x, w), ggml_round.matmul(x, Weight(w.name, w.qtype, w.shape, w.raw).exact))
    q = rng.standard_normal((4, 9, 64)).astype(np.float32)
    k, v = (rng.standard_normal((21, 3, 64)).astype(np.float16) for _ in range(2))
    assert np.array_equal(kernels.attention_compiled(q, k, v, 17), ggml_round.attention_f16(q, k, v, 17))
    g, u = (rng.standard_normal(1000).astype(np.float32) * 6 for _ in range(2))
    fused = g.copy()
    C.swiglu(fused, u)
    assert np.array_equal(fused, ggml_round.silu(g) * u)
    logits = rng.standard_normal((30, 8)).astype(np.float32) * 3
    experts, weights = np.empty((30, 2), np.int32), np.empty((30, 2), np.float32)
    C.route(logits, 30, 8, 2, False, experts, weights)
    assert np.array_equal(np.take_along_axis(ggml_round.softmax(logits), experts, 1), weights)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
def test_a_prompts_attention_is_each_rows_alone(dtype, kernel_width):
    """A prompt's rows walk each value lane with its sums in registers, a decode step's rows
    position after position: each row's bits are the same either way (an fp16 cache's lanes in
    AVX-512 where the CPU has it, then in AVX2) — query heads 2, 3 and 1 to
    a KV head (groups of 1 to 4 queries past the AVX-512 walk's four), 128, 96, 64 and 32
    dimensions (96 and 32: the AVX2 walk's 32 a pass),
    rows seeing 1 to 300 positions."""
    rng = np.random.default_rng(11)
    for D, H, Hkv in ((128, 8, 4), (64, 8, 4), (128, 6, 2), (64, 3, 3), (96, 4, 4), (32, 4, 2), (576, 4, 1)):
        S, T, start = 300, 9, 291
        q = rng.standard_normal((T, H, D)).astype(np.float32)
        k, v = (rng.standard_normal((S, Hkv, D)).astype(dtype) for _ in range(2))
        together = kernels.attention_compiled(q, k, v, start)
        alone = np.concatenate([kernels.attention_compiled(q[t:t + 1], k[:start + t + 1], v[:start + t + 1], start + t)
                                for t in range(T)])
        assert np.array_equal(together, alone), f"D={D} H={H} Hkv={Hkv}"
        first = kernels.attention_compiled(q[:3], k[:3], v[:3], 0)          # rows seeing 1, 2, 3 positions
        assert np.array_equal(first[2:], kernels.attention_compiled(q[2:3], k[:3], v[:3], 2))


def test_kiln_simd_avx2_turns_the_avx512_kernels_off_and_says_so():
    show = "from kiln.native import kernels; print(kernels.kernel_info()['avx512_vnni'])"
    off = subprocess.run([sys.executable, "-c", show], env={**os.environ, "KILN_SIMD": "avx2"},
                         capture_output=True, text=True, timeout=60)
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr
    assert kernels.kernel_info()["avx512_vnni"] == C.features()["avx512_vnni"]
    bad = subprocess.run([sys.executable, "-c", show], env={**os.environ, "KILN_SIMD": "sse9"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "KILN_SIMD='sse9' is not a kernel choice" in bad.stderr, bad.stderr



@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_dense_copies_and_looked_up_rows_are_gguf_pys_values(qtype):
    """The compiled dequantizer (a training job's dense copy, an embedding row a step) gives
    gguf-py's float32 bits, scales of every size and sign included."""
    rng = np.random.default_rng(int(qtype))
    w = random_weight(qtype, 37, 96, rng)
    raw = w.raw.copy()
    raw.reshape(37, 3, -1)[:, :, 0:2] = rng.choice(np.arange(0, 0x7c00, 7, dtype=np.uint16), (37, 3)).astype(
        "<u2").view(np.uint8).reshape(37, 3, 2) | np.array([0, 0x80], np.uint8) * rng.integers(0, 2, (37, 3, 1), np.uint8)
    w = Weight("w", qtype, (37, 96), raw)
    want = dequantize(raw, qtype).reshape(37, 96).astype(np.float32)
    assert np.array_equal(w.dense.view(np.uint32), want.view(np.uint32))
    ids = np.array([5, 0, 36, 5])
    fresh = Weight("w", qtype, (37, 96), raw)
    assert np.array_equal(fresh.rows(ids).view(np.uint32), want[ids].view(np.uint32))
