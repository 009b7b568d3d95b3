"""The KV cache keeps each KV head's positions together (head-major, native/kv_cache.py) and the
compiled attention reads any layout through its strides (csrc/kiln.h KvView): the layout changes
no bit, and an array the kernels cannot read is refused before any read."""

import numpy as np
import pytest

from kiln.native import kernels
from kiln.native.kv_cache import KVCache
from kiln.native.kv_types import kv_type

pytestmark = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled",
                                reason="the compiled kernels read the strides")


def _head_major(a: np.ndarray) -> np.ndarray:
    """The same rows, each KV head's positions together, seen position-first (as _rows)."""
    return np.ascontiguousarray(a.transpose(1, 0, 2)).transpose(1, 0, 2)


def test_the_cache_keeps_each_heads_positions_together():
    c = KVCache(2, 4, 64, 600)
    c.begin(list(range(300)))
    k, v = c.layer_buffers(1)
    assert k.shape[1:] == (4, 64) and k.strides[0] == 64 * 2 and k.strides[1] == len(k) * 64 * 2
    c.commit(list(range(300)))
    c.begin(list(range(200)))             # grown: still head-major, the rows kept
    assert c.layer_buffers(1)[0].strides[0] == 128
    twin = KVCache(2, 4, 64, 600)
    twin.copy_from(c)                     # a copy keeps the layout
    assert twin.layer_buffers(1)[0].strides == c.layer_buffers(1)[0].strides


@pytest.mark.parametrize("name", ["f16", "f32", "q8_0", "q4_0"])
def test_a_head_major_cache_gives_a_contiguous_ones_bits(name):
    """Prompt rows and a single decode row, every KV type, 2 query heads a KV head."""
    t = kv_type(name)
    rng = np.random.default_rng(5)
    S, Hkv, D, H = 70, 3, 64, 6
    k, v = (np.empty((S, Hkv, D // t.block), t.dtype) for _ in range(2))
    kernels.kv_store(t, rng.standard_normal((S, Hkv, D)).astype(np.float32), k)
    kernels.kv_store(t, rng.standard_normal((S, Hkv, D)).astype(np.float32), v)
    q = rng.standard_normal((5, H, D)).astype(np.float32)
    hk, hv = _head_major(k), _head_major(v)
    assert not hk.flags.c_contiguous
    assert np.array_equal(kernels.attention_compiled(q, hk, hv, 65), kernels.attention_compiled(q, k, v, 65))
    assert np.array_equal(kernels.attention_compiled(q[:1], hk[:40], hv[:40], 39),
                          kernels.attention_compiled(q[:1], k[:40], v[:40], 39))


def test_a_whole_forward_is_the_same_in_either_layout(default_model, monkeypatch):
    """Prompt, then decode steps through the one compiled call a layer: the logits of a
    head-major cache are a position-major one's, bit for bit."""
    def run():
        c = default_model.new_cache(64)
        out = [default_model.forward([1, 4093, 314, 260, 3458], c)]
        for tok in (42, 1337, 7):
            out.append(default_model.forward([tok], c))
        return np.stack(out)
    head_major = run()
    monkeypatch.setattr(KVCache, "_rows", lambda self, t, n: np.empty((n, self.n_head_kv, self.head_dim // t.block),
                                                                         t.dtype))
    c = default_model.new_cache(8)
    c.begin([1])
    assert c.layer_buffers(0)[0].flags.c_contiguous
    assert np.array_equal(run(), head_major)


BAD = {
    "reversed positions": lambda k: k[::-1],
    "a head short": lambda k: k[:, 1:],
    "rows cut": lambda k: k[:, :, 1:],
    "flat": lambda k: np.ascontiguousarray(k).reshape(len(k), -1),
    "too few positions": lambda k: k[:3],
}


@pytest.mark.parametrize("how", sorted(BAD))
def test_the_step_refuses_a_cache_it_cannot_read(default_model, monkeypatch, how):
    """A cache array of another shape, with a negative stride or without the position being
    written is a ValueError naming the step, never a read or write outside it."""
    real = KVCache.layer_buffers
    monkeypatch.setattr(KVCache, "layer_buffers", lambda self, i: tuple(BAD[how](a) for a in real(self, i)))
    c = default_model.new_cache(32)
    with pytest.raises(ValueError, match="decode_layer: (a KV cache must be|sequence 0's KV cache holds no position)"):
        for tok in (1, 2524, 3, 4, 5):
            default_model.forward([tok], c)
