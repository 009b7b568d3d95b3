"""What an evaluation run measured: per-arm metrics, and how two arms differ.

Accuracy carries a 95 % Wilson score interval (right near 0 and 1, unlike the normal
approximation); two arms are compared example by example — flips — with an exact two-sided
sign test on the examples that changed outcome.
"""

from __future__ import annotations

import math
from collections import Counter

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def metrics(results: list[dict], examples: list[dict]) -> dict:
    """results: one per example of one arm ({id, outcome, score, latency_s, prompt_tokens,
    completion_tokens}); examples: the suite's (for weights and tags)."""
    by_id = {e["id"]: e for e in examples}
    counts = Counter(r["outcome"] for r in results)
    n = len(results)
    k = counts.get("pass", 0)
    lo, hi = wilson(k, n)
    weights = [by_id[r["id"]]["weight"] for r in results]
    lat = [r["latency_s"] for r in results if r.get("latency_s") is not None]
    tags: dict[str, list[int]] = {}
    for r in results:
        for t in by_id[r["id"]]["tags"]:
            tags.setdefault(t, []).append(int(r["outcome"] == "pass"))
    return {
        "n": n, "counts": {o: counts.get(o, 0) for o in ("pass", "fail", "invalid", "error")},
        "accuracy": k / n if n else 0.0, "accuracy_ci95": [lo, hi],
        "mean_score": sum(r["score"] for r in results) / n if n else 0.0,
        "weighted_score": sum(w * r["score"] for w, r in zip(weights, results)) / sum(weights) if n else 0.0,
        "latency_s": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99)},
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in results),
        "completion_tokens": sum(r.get("completion_tokens") or 0 for r in results),
        "pass_rate_by_tag": {t: {"n": len(v), "pass": sum(v), "rate": sum(v) / len(v)} for t, v in sorted(tags.items())},
    }


def sign_test(improved: int, regressed: int) -> float:
    """Exact two-sided sign test: the chance of a split at least this uneven if neither arm
    were better (ties — both pass, both fail — carry no information and are left out)."""
    n = improved + regressed
    if n == 0:
        return 1.0
    k = min(improved, regressed)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(base: list[dict], other: list[dict]) -> dict:
    """Flips from arm `base` to arm `other`, matched by example id."""
    a = {r["id"]: r["outcome"] == "pass" for r in base}
    b = {r["id"]: r["outcome"] == "pass" for r in other}
    flips = {"improved": [], "regressed": [], "both_pass": 0, "both_fail": 0}
    for eid in a:
        if eid not in b:
            continue
        if a[eid] and b[eid]:
            flips["both_pass"] += 1
        elif not a[eid] and not b[eid]:
            flips["both_fail"] += 1
        else:
            flips["improved" if b[eid] else "regressed"].append(eid)
    return {"improved": len(flips["improved"]), "regressed": len(flips["regressed"]),
            "both_pass": flips["both_pass"], "both_fail": flips["both_fail"],
            "improved_ids": flips["improved"], "regressed_ids": flips["regressed"],
            "sign_test_p": sign_test(len(flips["improved"]), len(flips["regressed"]))}


def first_difference(a: str, b: str) -> int | None:
    """Byte offset of the first difference of two texts (UTF-8), None if identical."""
    x, y = a.encode(), b.encode()
    if x == y:
        return None
    n = min(len(x), len(y))
    return next((i for i in range(n) if x[i] != y[i]), n)


def compare_returns(base: dict, tuned: dict) -> dict:
    """Per-seed mean returns of two rollouts over the same seeds (summaries), and the exact sign
    test over the seeds where they differ: the gate an adapter passes before it is loaded."""
    seeds = sorted(set(base["group_returns"]) & set(tuned["group_returns"]), key=int)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    rows = [(int(g) + base["seed"], mean(base["group_returns"][g]), mean(tuned["group_returns"][g])) for g in seeds]
    wins, losses = sum(1 for _, b, t in rows if t > b), sum(1 for _, b, t in rows if t < b)
    return {"seeds": [r[0] for r in rows], "base_mean": mean([r[1] for r in rows]) if rows else None,
            "adapter_mean": mean([r[2] for r in rows]) if rows else None, "wins": wins, "losses": losses,
            "ties": len(rows) - wins - losses, "p_value": sign_test(wins, losses),
            "per_seed": [{"seed": s, "base": b, "adapter": t} for s, b, t in rows]}
