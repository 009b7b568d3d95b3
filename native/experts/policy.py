"""Which expert to evict: the expert cache's replacement policies, and an offline replay of
routing traces that compares them (bench/moe_stream.py) — the same classes the cache runs.

A policy tracks the resident keys ((layer, expert)) and answers `victim(busy)`: the key to evict,
never one in `busy` (experts the current layer is multiplying, reads in flight).

- `lru`: least recently used.
- `lfu`: least frequently used, counts halved every `age_every` tokens so old popularity fades
  (ties: least recent).
- `lrfu`: frequency-recency ("least stale"): each use adds 1 to a score that decays by half
  every `half_life` tokens; evict the lowest score — LFU for hot experts, LRU for the rest.
- any policy with `pinned`: keys that are never evicted (the hottest experts a warm-up found).

`replay(trace, policy, slots)` runs a trace — per routed layer, (layer, [experts]) — through a
cache of `slots` and returns the hit rate; `belady` is the offline optimum, the bound no policy
can beat.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np


class Policy:
    name = "?"

    def __init__(self, pinned=()):
        self.pinned = frozenset(pinned)
        self.order: OrderedDict = OrderedDict()       # resident keys, least recent first
        self.tokens = 0

    def tick(self, rows: int) -> None:
        """`rows` more tokens were routed (counted at layer 0)."""
        self.tokens += rows

    def touch(self, key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def admit(self, key) -> None:
        """A key read ahead, not yet used: resident (evictable) without counting a use."""
        self.order[key] = None
        self.order.move_to_end(key)

    def remove(self, key) -> None:
        self.order.pop(key, None)

    def candidates(self, busy):
        return (k for k in self.order if k not in busy and k not in self.pinned)

    def hottest_first(self, keys: list) -> list:
        """`keys` ordered as this policy would keep them: the last it would evict first."""
        at = {k: i for i, k in enumerate(self.order)}
        return sorted(keys, key=lambda k: at.get(k, -1), reverse=True)

    def victim(self, busy=frozenset()):
        return next(self.candidates(busy), None)


class LRU(Policy):
    name = "lru"


class LFU(Policy):
    name = "lfu"

    def __init__(self, pinned=(), age_every: int = 256):
        super().__init__(pinned)
        self.freq: dict = {}
        self.age_every = age_every

    def tick(self, rows: int) -> None:
        before = self.tokens
        super().tick(rows)
        if self.tokens // self.age_every > before // self.age_every:
            self.freq = {k: v / 2 for k, v in self.freq.items() if v >= 0.5}

    def touch(self, key) -> None:
        super().touch(key)
        self.freq[key] = self.freq.get(key, 0.0) + 1

    def victim(self, busy=frozenset()):
        return min(self.candidates(busy), key=lambda k: self.freq.get(k, 0.0), default=None)

    def hottest_first(self, keys: list) -> list:
        at = {k: i for i, k in enumerate(self.order)}               # ties: the most recent first
        return sorted(keys, key=lambda k: (self.freq.get(k, 0.0), at.get(k, -1)), reverse=True)


class LRFU(Policy):
    name = "lrfu"

    def __init__(self, pinned=(), half_life: float = 16.0):
        super().__init__(pinned)
        # per key, the log of its score scaled to token 0: log(s) + decay·t for a score s at
        # token t. Decay multiplies every score by the same factor, so this orders the keys as
        # the decayed scores do without an exp() per key; kept in arrays so that the victim —
        # sought on every miss and every guess read — is one masked argmin, not a Python loop
        # over the resident keys (3 ms per token at a 25 % cache of the bench model).
        self.decay = math.log(2) / half_life
        self.slot: dict = {}                          # key -> its index in the arrays
        self.keys: list = []
        self.level = np.zeros(0)
        self.last = np.zeros(0, np.int64)             # when last touched or admitted: ties go to the least recent
        self.resident = np.zeros(0, bool)
        self.evictable = np.zeros(0, bool)            # resident and not pinned
        self.clock = 0

    def _index(self, key) -> int:
        i = self.slot.get(key)
        if i is None:
            i = self.slot[key] = len(self.keys)
            self.keys.append(key)
            if i >= len(self.level):
                n = max(64, 2 * len(self.level))
                self.level = np.resize(self.level, n)
                self.last = np.resize(self.last, n)
                self.resident = np.resize(self.resident, n)
                self.evictable = np.resize(self.evictable, n)
            self.level[i], self.resident[i], self.evictable[i] = -np.inf, False, False
        return i

    def _now(self, key) -> float:
        """The key's score now."""
        i = self.slot.get(key)
        return 0.0 if i is None else math.exp(self.level[i] - self.decay * self.tokens)

    def _arrive(self, key) -> int:
        i = self._index(key)
        self.clock += 1
        self.last[i] = self.clock
        self.resident[i] = True
        self.evictable[i] = key not in self.pinned
        return i

    def touch(self, key) -> None:
        i = self._arrive(key)
        self.level[i] = math.log(self._now(key) + 1.0) + self.decay * self.tokens

    def admit(self, key) -> None:
        self._arrive(key)

    def remove(self, key) -> None:
        # keep the score: an expert evicted and read again resumes its history (bounded by E·L)
        i = self.slot.get(key)
        if i is not None:
            self.resident[i] = self.evictable[i] = False

    def hottest_first(self, keys: list) -> list:
        return sorted(keys, key=lambda k: self.level[self.slot[k]] if k in self.slot else -math.inf, reverse=True)

    def victim(self, busy=frozenset()):
        n = len(self.keys)
        ok = self.evictable[:n].copy()
        for k in busy:
            i = self.slot.get(k)
            if i is not None:
                ok[i] = False
        if not ok.any():
            return None
        level = np.where(ok, self.level[:n], np.inf)
        low = np.flatnonzero(level == level.min())
        if len(low) == 1:
            return self.keys[low[0]]
        return self.keys[low[np.argmin(self.last[low])]]


POLICIES = {"lru": LRU, "lfu": LFU, "lrfu": LRFU}


def make_policy(name: str, pinned=()) -> Policy:
    try:
        return POLICIES[name](pinned)
    except KeyError:
        raise ValueError(f"expert cache policy {name!r} is not one of {', '.join(POLICIES)}") from None


def hottest(trace, n: int) -> list:
    """The n most used (layer, expert) keys of a trace (a warm-up), to pin."""
    counts: dict = {}
    for layer, experts in trace:
        for e in experts:
            counts[(layer, e)] = counts.get((layer, e), 0) + 1
    return [k for k, _ in sorted(counts.items(), key=lambda kv: -kv[1])[:n]]


def replay(trace, policy: Policy, slots: int, warmup: int = 0) -> float:
    """Hit rate of `trace` (a list of (layer, experts) in routing order) through a cache of
    `slots` run by `policy`; the first `warmup` entries fill the cache uncounted."""
    resident: set = set()
    hits = total = 0
    for n, (layer, experts) in enumerate(trace):
        if layer == 0:
            policy.tick(1)
        busy = {(layer, e) for e in experts}
        for e in experts:
            key = (layer, e)
            counted = n >= warmup
            total += counted
            if key in resident:
                hits += counted
            else:
                if len(resident) >= slots:
                    old = policy.victim(busy)
                    if old is None:                # everything is busy or pinned: read, do not keep
                        continue
                    resident.discard(old)
                    policy.remove(old)
                resident.add(key)
            policy.touch(key)
    return hits / total if total else 0.0


def belady(trace, slots: int, warmup: int = 0) -> float:
    """The offline optimum (evict the key used furthest in the future): a bound, not a policy."""
    flat = [(layer, e) for layer, experts in trace for e in experts]
    starts, pos = [], 0
    for _, experts in trace:
        starts.append(pos)
        pos += len(experts)
    first_counted = starts[warmup] if warmup < len(starts) else len(flat)
    nxt, seen = [0] * len(flat), {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = seen.get(flat[i], math.inf)
        seen[flat[i]] = i
    resident: dict = {}                 # key -> next use
    hits = 0
    for i, key in enumerate(flat):
        if key in resident:
            hits += i >= first_counted
        elif len(resident) >= slots:
            del resident[max(resident, key=resident.get)]
        resident[key] = nxt[i]
    counted = len(flat) - first_counted
    return hits / counted if counted else 0.0
