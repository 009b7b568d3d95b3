"""The expert-cache tuner: measured sizes, the smallest within 5 % of the fastest, kept per model
file, and `expert_cache = "auto"` using it (or saying that it could not)."""

import os
import shutil
from types import SimpleNamespace

import pytest

from conftest import tiny_path
from kiln.native import kernels
from kiln.native.models.tune import WITHIN, load_tuned, save_tuned, tune
from kiln.supervisor.core import segments

pytestmark = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled",
                                reason="slots are multiplied in place by the compiled kernels")


@pytest.fixture(scope="module")
def tuned():
    return tune(tiny_path("qwen2moe"), tokens=6, warmup=2)


def test_tune_measures_each_size_and_suggests_the_smallest_near_the_best(tuned):
    runs = [r for r in tuned["runs"] if "tok_s" in r]
    assert len(runs) == 5 and all(r["tok_s"] > 0 and r["hit_rate"] is not None for r in runs)
    assert [r["cache_bytes"] for r in runs] == sorted(r["cache_bytes"] for r in runs)
    near = [r for r in runs if r["tok_s"] >= WITHIN * tuned["best_tok_s"]]
    assert tuned["suggested_bytes"] == min(r["cache_bytes"] for r in near)
    assert runs[-1]["hit_rate"] >= runs[0]["hit_rate"]          # a whole cache misses least


def test_sizes_that_do_not_fit_are_skipped_and_none_fitting_is_an_error():
    t = tune(tiny_path("qwen2moe"), tokens=2, warmup=1, available=(512 << 20) + 600_000, fractions=(0.1, 1.0))
    assert "skipped" in t["runs"][1] and t["suggested_fraction"] == 0.1
    # the smallest size asked for gives the cache that was measured (it gave one slot fewer, which
    # the worker's boot then refused as too small for the experts a token uses)
    from kiln.native.experts.cache import segment_bytes
    from kiln.native.experts.store import ExpertStore
    from kiln.native.gguf_file import read_gguf
    g = read_gguf(tiny_path("qwen2moe"), skip_arrays=True)
    store = ExpertStore(tiny_path("qwen2moe"), parts=g.parts)
    try:
        slots, _ = segment_bytes(g, store, t["suggested_bytes"])
        assert slots == max(g.metadata["qwen2moe.expert_used_count"], int(0.1 * 2 * 8))
    finally:
        store.close()
    with pytest.raises(ValueError, match="fits in the"):
        tune(tiny_path("qwen2moe"), tokens=2, warmup=1, available=1 << 20)


def test_a_dense_model_has_no_expert_cache_to_size():
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        tune(tiny_path("llama"), tokens=2)


def test_tuning_is_kept_per_file_and_forgotten_when_the_file_changes(tuned, tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_path("qwen2moe"), model)
    save_tuned(tmp_path, model, tuned)
    assert load_tuned(tmp_path, model) == tuned
    os.utime(model, (1, 1))                                      # replaced by another file
    assert load_tuned(tmp_path, model) is None


def test_expert_cache_auto_uses_the_tuning_or_says_it_has_none(tuned, tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_path("qwen2moe"), model)
    events = []

    def worker():
        return SimpleNamespace(kind="moe-stream", name="w", spec={"model": str(model), "settings": {"expert_cache": "auto"}})
    try:
        w = worker()
        segments.make_for_workers(tmp_path, [w], lambda kind, name, msg: events.append((kind, msg)))
        assert events[0][0] == "expert_cache_untuned" and "kiln models plan" in events[0][1]
        segments.remove_stale(tmp_path)
        save_tuned(tmp_path, model, tuned)
        events.clear()
        w = worker()
        segments.make_for_workers(tmp_path, [w], lambda kind, name, msg: events.append((kind, msg)))
        assert events[0][0] == "expert_cache_tuned"
        settings = w.spec["settings"]
        assert settings["cache_bytes"] <= tuned["suggested_bytes"] and settings["cache_slots"] >= 1
        if "shm" in settings:                                    # a shared cache: its segment, that size
            assert os.path.getsize(settings["shm"]) == settings["cache_bytes"]
    finally:
        segments.remove_stale(tmp_path)
