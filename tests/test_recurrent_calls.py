"""The mixers with compiled calls of their own — qwen35's gated delta net, lfm2's gated short
convolution, deepseek2's latent attention: a prompt's rows are its tokens stepped one by one, and
a buffer not of its shape is a clear error before anything is read or written. (Their decode
steps in one call with the blocks' bits: test_batch_invariance.py's families.)"""

import numpy as np
import pytest

from conftest import tiny_path
from kiln.native import kernels
from kiln.native.model import load_model

pytestmark = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled",
                                reason="the mixers' calls are the compiled extension's")


def test_the_conv_layer_call_refuses_a_state_it_cannot_hold():
    """A conv state of the wrong shape, or a kernel wider than the call takes, is a clear error
    before anything is read or written."""
    from kiln.native.arch.lfm2 import ShortConv
    m = load_model(tiny_path("lfm2"))
    L = next(L for L in m.layers if type(L.attn) is ShortConv)
    a, n = L.attn, m.config.n_embd
    x = np.random.default_rng(0).standard_normal((1, n)).astype(np.float32)
    args = (x, L.attn_norm, m.config.rms_eps, (a.in_proj.raw, a.out_proj.raw), (int(a.in_proj.qtype), int(a.out_proj.qtype)))
    K = a.conv.shape[1]
    with pytest.raises(ValueError, match="row 0's state is not"):
        kernels.compiled_module().decode_conv_layer(*args, a.conv, [np.zeros((K, n), np.float32)], None, 0)
    with pytest.raises(ValueError, match="conv kernel"):
        kernels.compiled_module().decode_conv_layer(*args, np.zeros((n, 65), np.float32), [np.zeros((64, n), np.float32)],
                                                    None, 0)
    before, state = x.copy(), np.zeros((K - 1, n), np.float32)
    kernels.compiled_module().decode_conv_layer(*args, a.conv, [state], None, 0)
    assert np.isfinite(x).all() and not np.array_equal(x, before) and state[-1].any()    # the input kept


def test_the_latent_attention_call_refuses_weights_and_caches_not_of_its_shape():
    """deepseek2's layer call checks every weight against the dimensions it is given, the query's
    one form, the norms and each row's cache before it reads anything; a good call writes the row
    and its key."""
    m = load_model(tiny_path("deepseek2"))
    L, c = m.layers[0], m.config
    a, R, C = L.attn, c.rope_dim, c.get("kv_lora_rank")
    k, v = np.zeros((8, 1, C + R), np.float16), np.zeros((8, 1, C + R), np.float16)    # a cache's view: one KV head
    x = np.random.default_rng(0).standard_normal((1, c.n_embd)).astype(np.float32)
    cos, sin = np.ones((1, R // 2), np.float32), np.zeros((1, R // 2), np.float32)
    ws = [a.wq.raw, None, None, a.wkv_a.raw, a.wk_b.raw, a.wv_b.raw, a.wo.raw]
    types = (int(a.wq.qtype), -1, -1, int(a.wkv_a.qtype), int(a.wk_b.qtype), int(a.wv_b.qtype), int(a.wo.qtype))
    dims = (c.n_head, C, R, c.get("k_mla") - R, c.get("v_head"))

    def call(ws=ws, dims=dims, norms=(None, a.kv_a_norm), seqs=((k, v, 0),)):
        kernels.compiled_module().decode_mla_layer(x, L.attn_norm, c.rms_eps, tuple(ws), types, norms, dims, list(seqs),
                                                   cos, sin, False, (1, 1), 0.1, None, 0)
    for kw, match in [({"ws": ws[:4] + [a.wk_b.raw[:-1]] + ws[5:]}, "attn_k_b is smaller"),
                      ({"ws": [a.wq.raw, a.wq.raw, a.wq.raw] + ws[3:]}, "one query form, not both"),
                      ({"ws": [None] + ws[1:]}, "weight 1 is missing"),
                      ({"dims": dims[:1] + (C + 8,) + dims[2:]}, "not a layer's"),
                      ({"dims": dims[:1] + (1024,) + dims[2:]}, "not a layer's"),
                      ({"norms": (None, a.kv_a_norm[:-1])}, "not a layer's"),
                      ({"seqs": ((k, v, k.shape[0]),)}, "holds no position")]:
        before = x.copy()
        with pytest.raises(ValueError, match=match):
            call(**kw)
        assert np.array_equal(x, before) and not k[0].any()
    call()
    assert np.isfinite(x).all() and not np.array_equal(x, before) and k[0].any() and not k[1].any()


def test_the_delta_net_calls_refuse_buffers_not_of_their_shape():
    """The compiled delta net takes its shapes from the caller: a state, a conv history, a row or
    a run of rows of another size is refused with what was wrong, never read or written past
    its end."""
    from kiln.native.kernels import compiled_module
    C = compiled_module()
    if C is None:
        pytest.skip("no compiled extension")
    Hk, Hv, dk, dv, K, R = 2, 4, 8, 8, 4, 3
    ch = 2 * Hk * dk + Hv * dv
    spec = (np.ones((ch, K), np.float32), np.zeros(Hv, np.float32), -np.ones(Hv, np.float32), np.ones(dv, np.float32))
    rows = (np.ones((R, ch), np.float32), np.ones((R, Hv * dv), np.float32), np.zeros((R, Hv), np.float32),
            np.zeros((R, Hv), np.float32))
    conv, S = np.zeros((K - 1, ch), np.float32), np.zeros((Hv, dk, dv), np.float32)
    out = np.empty((R, Hv * dv), np.float32)
    C.delta_rows(spec, (Hk, Hv, dk, dv, K), 1e-6, *rows, [(0, R, conv, S)], out, 1)
    assert np.isfinite(out).all() and S.any() and conv.all()
    for runs, dims, match in [([(0, R, conv, np.zeros((Hv, dk, dv - 1), np.float32))], (Hk, Hv, dk, dv, K), "conv inputs or state"),
                              ([(0, R, conv, S)], (Hk, Hv, dk, dv, K + 1), "not its shape"),
                              ([(0, R, conv, S)], (Hk, Hv, dk, 100000, K), "row buffer|outside"),
                              ([(1, R, conv, S)], (Hk, Hv, dk, dv, K), "not within the 3 rows"),
                              ([(0, 2, conv, S), (1, 2, conv, S)], (Hk, Hv, dk, dv, K), "after the runs before it"),
                              ([], (Hk, Hv, dk, dv, K), "1 to 64 runs")]:
        with pytest.raises(ValueError, match=match):
            C.delta_rows(spec, dims, 1e-6, *rows, runs, out, 1)


def test_a_prompts_delta_net_is_its_tokens_stepped_one_by_one():
    """The compiled delta net runs a prompt token after token (the recurrence, one pass over each
    head's state per token): two sequences' runs in one call give the bits — outputs, states,
    kept conv inputs — of the second's tokens stepped one at a time from the same state."""
    from kiln.native.kernels import compiled_module
    C = compiled_module()
    if C is None:
        pytest.skip("no compiled extension")
    Hk, Hv, dk, dv, K, R = 4, 8, 64, 64, 4, 37
    ch, rng = 2 * Hk * dk + Hv * dv, np.random.default_rng(0)
    spec = (rng.normal(size=(ch, K)).astype(np.float32), rng.normal(size=Hv).astype(np.float32),
            -np.abs(rng.normal(size=Hv)).astype(np.float32), rng.normal(size=dv).astype(np.float32))
    rows = [rng.normal(size=s).astype(np.float32) for s in [(R, ch), (R, Hv * dv), (R, Hv), (R, Hv)]]
    first = (np.zeros((K - 1, ch), np.float32), np.zeros((Hv, dk, dv), np.float32))
    conv, S = rng.normal(size=(K - 1, ch)).astype(np.float32), rng.normal(size=(Hv, dk, dv)).astype(np.float32) / 10
    conv_steps, S_steps = conv.copy(), S.copy()
    out = np.empty((R, Hv * dv), np.float32)
    C.delta_rows(spec, (Hk, Hv, dk, dv, K), 1e-6, *rows, [(0, 20, *first), (20, 17, conv, S)], out, 2)
    steps = np.empty((17, Hv * dv), np.float32)
    for t in range(20, R):
        C.delta_rows(spec, (Hk, Hv, dk, dv, K), 1e-6, *[np.ascontiguousarray(r[t:t + 1]) for r in rows],
                     [(0, 1, conv_steps, S_steps)], steps[t - 20:t - 19], 1)
    assert np.array_equal(out[20:], steps) and np.array_equal(S, S_steps) and np.array_equal(conv, conv_steps)
    assert np.isfinite(out).all() and first[1].any()
