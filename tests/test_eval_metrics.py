"""Evaluation metrics: Wilson intervals, percentiles, flips and the exact sign test."""

import math

import pytest

from kiln.native.eval_metrics import compare, first_difference, metrics, percentile, sign_test, wilson


def test_wilson_interval_matches_published_values():
    lo, hi = wilson(8, 20)                      # p = 0.4, n = 20: 0.2188 – 0.6134
    assert lo == pytest.approx(0.2188, abs=1e-4) and hi == pytest.approx(0.6134, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(10, 10)[0] == pytest.approx(0.7225, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)


def test_sign_test_is_exact_and_two_sided():
    assert sign_test(0, 0) == 1.0
    assert sign_test(6, 1) == pytest.approx(2 * (1 + 7) / 128)
    assert sign_test(1, 6) == sign_test(6, 1)
    assert sign_test(10, 0) == pytest.approx(2 / 1024)
    assert sign_test(5, 5) == 1.0
    n, k = 30, 8                                    # against the binomial sum written out
    assert sign_test(k, n - k) == pytest.approx(2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def test_percentiles_interpolate_like_numpy():
    v = [0.1, 0.4, 0.2, 0.3]
    assert percentile(v, 50) == pytest.approx(0.25)
    assert percentile(v, 90) == pytest.approx(0.37)
    assert percentile([], 50) is None


def _ex(i, tags=(), weight=1):
    return {"id": f"e{i}", "tags": list(tags), "weight": weight}


def test_metrics_count_outcomes_weights_and_tags():
    examples = [_ex(0, ["a"], 3), _ex(1, ["a", "b"]), _ex(2, ["b"]), _ex(3)]
    results = [{"id": "e0", "outcome": "pass", "score": 1.0, "latency_s": 0.1, "prompt_tokens": 5, "completion_tokens": 2},
               {"id": "e1", "outcome": "fail", "score": 0.0, "latency_s": 0.2, "prompt_tokens": 5, "completion_tokens": 3},
               {"id": "e2", "outcome": "invalid", "score": 0.0, "latency_s": 0.3, "prompt_tokens": 5, "completion_tokens": 4},
               {"id": "e3", "outcome": "error", "score": 0.0, "latency_s": None}]
    m = metrics(results, examples)
    assert m["counts"] == {"pass": 1, "fail": 1, "invalid": 1, "error": 1} and m["n"] == 4
    assert m["accuracy"] == 0.25 and m["mean_score"] == 0.25 and m["weighted_score"] == pytest.approx(3 / 6)
    assert m["pass_rate_by_tag"] == {"a": {"n": 2, "pass": 1, "rate": 0.5}, "b": {"n": 2, "pass": 0, "rate": 0.0}}
    assert m["latency_s"]["p50"] == pytest.approx(0.2) and m["prompt_tokens"] == 15 and m["completion_tokens"] == 9


def test_compare_counts_flips_and_identical_arms_have_none():
    a = [{"id": f"e{i}", "outcome": o} for i, o in enumerate(["pass", "fail", "fail", "pass", "invalid"])]
    b = [{"id": f"e{i}", "outcome": o} for i, o in enumerate(["pass", "pass", "fail", "fail", "pass"])]
    c = compare(a, b)
    assert (c["improved"], c["regressed"], c["both_pass"], c["both_fail"]) == (2, 1, 1, 1)
    assert c["improved_ids"] == ["e1", "e4"] and c["regressed_ids"] == ["e3"]
    same = compare(a, a)
    assert same["improved"] == same["regressed"] == 0 and same["sign_test_p"] == 1.0


def test_first_difference_is_a_byte_offset():
    assert first_difference("same", "same") is None
    assert first_difference("abc", "abd") == 2
    assert first_difference("é1", "é2") == 2           # é is two bytes
    assert first_difference("ab", "abc") == 2
