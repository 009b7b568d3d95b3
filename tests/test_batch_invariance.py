"""On the compiled path a token's logits do not depend on how the prompt was batched: so
prefix reuse, batched decode and a fresh run give the same bits (and the same greedy text)."""

import numpy as np
import pytest

from conftest import tiny_path
from kiln.native import kernels
from kiln.native.model import load_model

pytestmark = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled",
                                reason="batch invariance is a property of the compiled kernels")


def _chunks(model, ids, sizes):
    cache = model.new_cache()
    out, i = None, 0
    for n in sizes:
        out = model.forward(ids[i:i + n], cache, all_logits=True)
        i += n
    assert i == len(ids)
    return out[-1]


@pytest.mark.parametrize("which", ["default", "tiny-qwen2moe"])
def test_logits_are_identical_however_the_prompt_is_batched(which, default_model):
    model = default_model if which == "default" else load_model(tiny_path("qwen2moe"))
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it sleeps.")
    whole = _chunks(model, ids, [len(ids)])
    assert np.array_equal(whole, _chunks(model, ids, [1] * len(ids)))
    assert np.array_equal(whole, _chunks(model, ids, [5, 1, 7, len(ids) - 13]))
