"""The expert cache's replacement policies (native/expert_policy.py), on hand-made traces whose
right answer is known, and against Belady's optimum on random skewed ones."""

import random

import pytest

from kiln.native.experts.policy import LFU, LRFU, LRU, belady, hottest, make_policy, replay


def test_lru_evicts_the_least_recently_used():
    p = LRU()
    for k in "abc":
        p.touch(k)
    p.touch("a")
    assert p.victim() == "b"
    assert p.victim(busy={"b"}) == "c"


def test_lfu_keeps_the_frequent_and_forgets_with_age():
    p = LFU(age_every=4)
    for k in ["a", "a", "a", "b"]:
        p.touch(k)
    assert p.victim() == "b"
    p.tick(4)                                    # counts halve: a 1.5, b 0.5
    p.touch("b")
    p.touch("b")                                 # b 2.5 > a 1.5
    assert p.victim() == "a"


def test_lrfu_decays_old_popularity_by_its_half_life():
    p = LRFU(half_life=2)
    for _ in range(4):
        p.touch("old")                           # 4 uses long ago
    p.tick(20)                                   # ten half-lives: worth 4/1024
    p.touch("new")
    assert p.victim() == "old"
    q = LRFU(half_life=1000)                     # without decay it is LFU: old stays
    for _ in range(4):
        q.touch("old")
    q.tick(20)
    q.touch("new")
    assert q.victim() == "new"


def test_pinned_and_busy_keys_are_never_victims():
    p = make_policy("lru", pinned=["a"])
    for k in "abc":
        p.touch(k)
    assert p.victim() == "b"
    assert p.victim(busy={"b", "c"}) is None


def test_a_key_read_ahead_is_evictable_without_counting_a_use():
    p = LFU()
    p.touch("a")
    p.admit("b")
    assert p.victim() == "b"


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="lru, lfu, lrfu"):
        make_policy("fifo")


def _skewed_trace(seed=0, tokens=400, layers=4, experts=16, k=2):
    rnd = random.Random(seed)
    weights = [1 / (e + 1) ** 1.2 for e in range(experts)]      # Zipf-like: a few hot experts
    return [(layer, sorted(set(rnd.choices(range(experts), weights, k=k))))
            for _ in range(tokens) for layer in range(layers)]


def test_replay_counts_hits_and_belady_bounds_every_policy():
    trace = [(0, [1]), (0, [2]), (0, [1]), (0, [3]), (0, [1]), (0, [2])]
    assert replay(trace, LRU(), slots=2) == pytest.approx(2 / 6)   # 1 hits twice; 2 is evicted by 3
    cyclic = [(0, [1]), (0, [2]), (0, [3])] * 2
    assert replay(cyclic, LRU(), slots=2) == 0                     # LRU's worst case: a loop one too long
    assert belady(cyclic, slots=2) == pytest.approx(2 / 6)         # the optimum keeps what comes back first
    for seed in range(3):
        trace = _skewed_trace(seed)
        best = belady(trace, 16, warmup=100)
        for name in ("lru", "lfu", "lrfu"):
            assert replay(trace, make_policy(name), 16, warmup=100) <= best + 1e-9


def test_frequency_beats_recency_on_skewed_routing():
    """The reason lrfu is the default: on skewed routing with a small cache, recency alone keeps
    whatever came last; counting uses keeps the hot experts."""
    trace = _skewed_trace(1, tokens=800)
    slots = 16
    lru, lrfu = replay(trace, make_policy("lru"), slots, 200), replay(trace, make_policy("lrfu"), slots, 200)
    assert lrfu > lru
    pinned = replay(trace, make_policy("lru", hottest(trace[:200], slots // 2)), slots, 200)
    assert pinned > lru
