"""A new expert cache starts with what its predecessor held: the hot list (hottest first by the
policy), saved for one file and refused for any other, preloaded into free slots — bit-exact
answers, hits from the first token, and a disk that fails during the preload loses nothing."""

import errno
import os
import shutil
import time

import numpy as np
import pytest

from conftest import reference, tiny_path
from kiln.native import kernels
from kiln.native.experts import warm as expert_warm
from kiln.native.experts.cache import ExpertCache
from kiln.native.experts.store import ExpertStore
from kiln.native.experts.warm import load_hot, save_hot
from kiln.native.model import load_model

pytestmark = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled",
                                reason="slots are multiplied in place by the compiled kernels")
SLOTS = 30 * 2


def served_cache(m, path, monkeypatch) -> ExpertCache:
    """A cache that has served a prompt and some decode steps, its hot list snapshot every token."""
    monkeypatch.setattr(expert_warm, "HOT_EVERY", 0.0)
    c = ExpertCache(m.gguf, ExpertStore(path), slots=SLOTS, policy="lrfu")
    m.expert_provider = c
    kv = m.new_cache(256)
    m.forward(reference("smollm2-moe-e8k2")[0]["prompts"][0]["ids"], kv)
    for t in np.random.default_rng(3).integers(0, m.config.n_vocab, 12).tolist():
        m.forward([t], kv)
    return c


def test_a_new_cache_preloads_its_predecessors_hottest_experts_and_answers_the_same(e8k2_path, tmp_path, monkeypatch):
    m = load_model(e8k2_path)
    ids = reference("smollm2-moe-e8k2")[0]["prompts"][1]["ids"]
    in_ram = m.forward(ids, m.new_cache(), all_logits=True)
    old = served_cache(m, e8k2_path, monkeypatch)
    assert old.hot and old.hot_version > 1                         # taken at each token's first layer
    old._note_hot()                                                 # and now, after the last layer
    hot = old.hot
    assert set(hot) == set(old.index) and len(hot) <= SLOTS
    levels = [old.policy.level[old.policy.slot[k]] for k in hot]
    assert levels == sorted(levels, reverse=True)                   # the policy's keepers first
    save_hot(tmp_path / "hot.json", e8k2_path, hot)
    assert load_hot(tmp_path / "hot.json", e8k2_path) == hot
    old.close()

    new = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=SLOTS, policy="lrfu")
    assert new.preload(hot + [(99, 0), (0, 99)], 30.0) == len(hot)  # what the model lacks is skipped
    assert set(new.index) == set(hot) and not new.pending
    st = new.stats()
    assert st["preloaded_at_start"] == len(hot) and st["misses"] == 0 and st["io_ms_per_token"] is None
    assert new.wait_seconds == 0                                    # no forward stalled
    m.expert_provider = new
    assert np.array_equal(m.forward(ids, m.new_cache(), all_logits=True), in_ram)
    assert new.stats()["hits"] > 0
    new.close()


def test_a_preload_takes_only_free_slots_and_stops_at_its_deadline(e8k2_path, monkeypatch):
    m = load_model(e8k2_path)
    keys = [(layer, e) for layer in range(30) for e in range(8)]   # every expert: more than the slots
    c = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=SLOTS)
    assert c.preload(keys, 0.0) == 0 and len(c.free) == SLOTS
    assert c.preload(keys, 60.0) == SLOTS and not c.free
    assert c.preload([(0, 0)], 60.0) == 0                          # nothing free: nothing evicted
    c.close()


def test_a_disk_that_fails_during_the_preload_ends_it_and_loses_nothing(e8k2_path):
    m = load_model(e8k2_path)
    c = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=SLOTS)
    c.io.reader.fault(0, 1 << 40, errno.EIO)
    assert c.preload([(layer, 0) for layer in range(30)], 60.0) == 0
    deadline = time.monotonic() + 10
    while c.pending:                                                # the rest of the batch ends too
        assert time.monotonic() < deadline
        c._reap()
        time.sleep(0.005)
    assert "Input/output error" in c.stats()["last_read_error"] and len(c.free) == SLOTS and not c.index
    c.io.reader.fault()
    c.close()


def test_each_policy_puts_the_experts_it_would_keep_longest_first():
    from kiln.native.experts.policy import make_policy
    uses = [(0, 1), (0, 2), (0, 2), (0, 3), (0, 2), (0, 3), (0, 1), (0, 4)]
    order = {}
    for name in ("lru", "lfu", "lrfu"):
        p = make_policy(name)
        for k in uses:
            p.touch(k)
            p.tick(1)
        keys = sorted(set(uses))
        order[name] = p.hottest_first(keys)
        evicted = []                                                # the reverse of its eviction order
        while (v := p.victim()) is not None:
            evicted.append(v)
            p.remove(v)
        assert order[name] == evicted[::-1], name
    assert order["lru"][0] == (0, 4) and order["lfu"][0] == (0, 2)


def test_a_hot_list_is_refused_for_another_file_or_a_changed_one(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_path("qwen2moe"), model)
    save_hot(tmp_path / "hot.json", model, [(0, 1), (2, 3)])
    assert load_hot(tmp_path / "hot.json", model) == [(0, 1), (2, 3)]
    other = tmp_path / "other.gguf"
    shutil.copy(model, other)
    assert load_hot(tmp_path / "hot.json", other) is None           # another path
    os.utime(model, (1, 1))
    assert load_hot(tmp_path / "hot.json", model) is None           # the same path, another version
    (tmp_path / "bad.json").write_text("{not json")
    assert load_hot(tmp_path / "bad.json", model) is None
    assert load_hot(tmp_path / "missing.json", model) is None
