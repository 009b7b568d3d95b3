"""Prompt-lookup speculative decoding: drafts from the text itself, no second model.

When the last few tokens already occurred earlier in the conversation (code being rewritten, a
document being quoted), the tokens that followed them then are a good guess for what follows
now. The scheduler runs the guess through the model in one forward together with the token just
chosen, then samples each position from the model's own logits exactly as plain decoding would
— the same sampler, the same random draws — and keeps the guess only as far as it matches. So
the text is identical to plain decoding (greedy or seeded sampling alike, since a multi-token
forward gives the same bits as one token at a time on every kernel path); only the number of
forwards changes. How much of a proposal is checked is chosen from the measured cost of a
forward of that many rows and the acceptance so far (DraftControl): drafting is off while it
does not pay, except for a one-token probe now and then.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable, NamedTuple

import numpy as np

MIN_NGRAM, MAX_NGRAM = 2, 4
MAX_DRAFT = 16
GUESS_PER_ROW = 0.35      # an unmeasured forward of T rows: 1 + 0.35 (T - 1) one-row forwards
MIN_GAIN = 0.03           # draft only when it is expected to beat a plain step by this much
PROBE_EVERY = 16          # steps without a draft before a one-token probe
DECAY = 0.9               # per draft: the acceptance estimate follows the last ~10 drafts
PRIOR_WEIGHT = 4.0        # a request starts from what drafts here kept lately, worth this many drafts


def ema(old: float | None, new: float, a: float = 0.2) -> float:
    """A moving average (the first value taken as it is)."""
    return new if old is None else (1 - a) * old + a * new


class Proposal(NamedTuple):
    tokens: list[int]
    source: int | None        # where in the history the tokens begin (None: no proposal)
    match: int = 0            # how many tokens of the history's tail matched there


def propose(history: list[int], k: int, cursor: int | None = None, window: int = 4096) -> Proposal:
    """Up to k tokens that followed an earlier occurrence of the history's last n tokens (the
    longest n in MAX_NGRAM..MIN_NGRAM that occurs), and where in the history they begin — or
    ([], None). The occurrence: the first at or after `cursor` (where the text being copied
    had got to: the source position just past the last kept draft token), else the latest.
    A rewrite walks through its source in order, so after it strays (a blank line dropped, a
    name changed) the next match along the source beats the latest one, which is often the
    model's own copy of an earlier, similar line."""
    if k <= 0 or len(history) < MIN_NGRAM + 1:
        return Proposal([], None)
    base = max(0, len(history) - window)
    h = np.asarray(history[base:], dtype=np.int64)
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if len(h) <= n:
            continue
        # starts i (i + n < len) where h[i:i+n] == the tail, in order — whole-array compares
        # (this runs every step a request decodes alone)
        last = len(h) - n
        hit = h[:last] == h[last]
        for j in range(1, n):
            hit &= h[j:last + j] == h[last + j]
        starts = np.flatnonzero(hit)
        if not len(starts):
            continue
        along = starts[base + starts + n >= cursor] if cursor is not None else starts[:0]
        i = int(along[0] if len(along) else starts[-1])
        return Proposal([int(t) for t in h[i + n:i + n + k]], base + i + n, n)
    return Proposal([], None)


class ForwardCosts:
    """What a forward of T rows costs on this machine, as the scheduler runs them: the last few
    times of each size (a median, so one stall of a shared machine does not rule a size out).
    A size not yet measured is guessed at the per-row cost of the largest well-measured size
    below it (GUESS_PER_ROW with none); one measured fewer than three times at the better of
    its median and that guess, so that a size is tried before it is judged."""

    KEEP = 5

    def __init__(self):
        self.samples: dict[int, deque] = {}

    def record(self, rows: int, seconds: float) -> None:
        self.samples.setdefault(rows, deque(maxlen=self.KEEP)).append(seconds)

    def seconds(self, rows: int) -> float | None:
        got = self.samples.get(rows)
        return statistics.median(got) if got else None

    def ratio(self, rows: int) -> float | None:
        """The cost of `rows` rows over one row's; None until one row has been measured."""
        one = self.seconds(1)
        if one is None:
            return None
        # an unmeasured size: the per-row cost of the largest well-measured size below it
        known = [r for r, got in self.samples.items() if 1 < r < rows and len(got) >= 3]
        per_row = (statistics.median(self.samples[max(known)]) / one - 1) / (max(known) - 1) if known else GUESS_PER_ROW
        guess = 1.0 + per_row * (rows - 1)
        got = self.samples.get(rows)
        if not got:
            return guess
        measured = statistics.median(got) / one
        return min(measured, guess) if len(got) < 3 else measured


class DraftControl:
    """How many of a proposal's tokens to check: the number that makes the most tokens per
    second, from two kept-rates and what a forward of that many rows costs. A proposal is
    either in step with the text or not, so the first token is judged apart from the rest:
    p0, the chance the first draft token is kept (per length of the n-gram match); p1, the chance a token is kept when the one
    before it was (both counts decayed, so they follow the text). A draft of k keeps
    1 + p0 (1 + p1 + … + p1^(k-1)) tokens on average for ratio(k + 1) plain steps; when no k
    beats a plain step, no draft — but a one-token probe every PROBE_EVERY steps keeps the
    estimate alive for when the text turns repetitive.

    `prior`: the scheduler's own DraftControl, which hears every request's drafts. A request
    starts from its counts scaled to PRIOR_WEIGHT drafts (rather than from "half kept", which
    checked one token at a time for the first several drafts of every request) and then follows
    its own text."""

    def __init__(self, at_least: int = 0, prior: "DraftControl | None" = None):
        self.at_least = at_least                 # draft at least this many whatever it costs (draft_min)
        self.prior = prior
        self.first: dict[int, list] = {}         # match length -> (kept, tried) of first tokens
        self.match = 0                           # the match length of the proposal being judged
        self.later = [1.0, 2.0]                  # the same for tokens after a kept one
        if prior is not None:
            self.first = {m: _scaled(c) for m, c in prior.first.items()}
            self.later = _scaled(prior.later)
        self.drafted = self.accepted = 0
        self.skipped = 0                         # steps since the last draft
        self.cursor: int | None = None           # where in the history the copied text had got to

    @property
    def p0(self) -> float:
        kept, tried = self.first.get(self.match, (1.0, 2.0))     # the prior: half kept
        return kept / tried

    @property
    def p1(self) -> float:
        return self.later[0] / self.later[1]

    def expected(self, k: int) -> float:
        """Tokens a draft of k yields on average (the token sampled after it included)."""
        p1 = self.p1
        run = (1 - p1 ** k) / (1 - p1) if p1 < 1 else float(k)
        return 1.0 + self.p0 * run

    def lookup(self, history: list[int], room: int, costs: ForwardCosts) -> tuple[list[int], int | None]:
        """A prompt-lookup draft worth checking now (at most `room` tokens; [] for a plain step)
        and where in the history it was copied from."""
        draft, source, match = propose(history, min(MAX_DRAFT, room), self.cursor) if room > 0 else ([], None, 0)
        return draft[:self.choose(len(draft), costs, match=match)], source

    def choose(self, available: int, costs: ForwardCosts, per_token: float = 0.0, match: int = 0) -> int:
        """How many of `available` proposed tokens to check now (0: a plain step); `per_token`:
        what making each draft token costs, in plain steps (a draft model's forward); `match`:
        how long the n-gram behind the proposal is — the first token's kept-rate is kept per
        length (a 3- or 4-token match is kept far more often than a 2-token one)."""
        self.match = match
        if available <= 0:
            return 0
        best, gain = 0, 1.0 + MIN_GAIN
        for k in range(1, min(available, MAX_DRAFT) + 1):
            r = costs.ratio(k + 1)
            if r is None:
                break
            r += k * per_token
            if self.expected(k) / r > gain:
                best, gain = k, self.expected(k) / r
        best = max(best, min(self.at_least, available, MAX_DRAFT))
        if best:
            self.skipped = 0
            return best
        self.skipped += 1
        if self.skipped >= PROBE_EVERY and costs.ratio(2) is not None:
            self.skipped = 0
            return 1
        return 0

    def update(self, drafted: int, accepted: int, match: int | None = None) -> None:
        if drafted == 0:
            return
        match = self.match if match is None else match
        self.drafted += drafted
        self.accepted += accepted
        later_tried = min(accepted, drafted - 1)           # tokens 2.. were judged while the last held
        for counts, kept, tried in ((self.first.setdefault(match, [1.0, 2.0]), min(accepted, 1), 1),
                                    (self.later, max(accepted - 1, 0), later_tried)):
            counts[0] = DECAY * counts[0] + kept
            counts[1] = DECAY * counts[1] + tried
        if self.prior is not None:
            self.prior.update(drafted, accepted, match)


def verify(gen, rows, draft: list[int], emit: Callable) -> tuple[int, object]:
    """Sample each drafted position as plain decoding would (`gen.step` on its logits row),
    emitting every token chosen, and keep the draft as far as it matches: (tokens kept, the
    first token that differed — or None when every draft token held)."""
    for i, d in enumerate(draft):
        tok = gen.step(rows[i])
        emit(tok)
        if tok.id != d or gen.done:
            return i, tok
    return len(draft), None


def _scaled(counts: list) -> list:
    """(kept, tried) with the same rate, worth at most PRIOR_WEIGHT tries."""
    kept, tried = counts
    f = min(1.0, PRIOR_WEIGHT / tried) if tried > 0 else 1.0
    return [kept * f, tried * f]


class Speculation:
    """A request decoding alone checks a draft in the same forward as its next token (mixed
    into native/scheduler.py's Scheduler: its model, caches, costs and counters)."""

    def _speculate(self, job, t: int) -> bool:
        """Run `t` and a prompt-lookup draft in one forward; sample each position as plain
        decoding would and keep the draft as far as it matches. False: no draft was tried."""
        cache = self.seqs[job.slot].cache
        if not (self.speculative and job.params.speculative and cache.can_rewind):
            return False
        if job.gen.shifts and self.draft_model is not None:
            return False            # the draft model's cache holds the whole history: past a shift it would not fit
        if job.spans is not None and self.draft_model is not None:
            return False            # a prompt with images: the draft model has no vision
        if job.draft is None:
            job.draft = DraftControl(self.draft_min, prior=self.kept)
        gen = job.gen
        room = min(job.params.max_tokens - gen.n_out - 1, self.n_ctx - cache.n - 2)
        if self.draft_model is not None:
            k = job.draft.choose(min(MAX_DRAFT, room), self.costs,
                                 self.draft_model.cost_per_token(self.costs.seconds(1)) or 0.0)
            if k and job.draft_state is None:
                job.draft_state = self.draft_model.new_state(self.n_ctx)
            try:
                draft, source = (self.draft_model.propose(job.draft_state, gen.history, k) if k else []), None
            except Exception as e:  # noqa: BLE001 - the draft model failing ends the request, not the worker
                self._end(job, e)
                return True
        else:
            draft, source = job.draft.lookup(gen.history, room, self.costs)
        if not draft:
            return False
        base = cache.n
        t0 = time.perf_counter()
        try:
            rows = self.model.forward([t] + draft, cache, all_logits=True, adapter=job.adapter)
            took = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            self._end(job, e)
            return True
        accepted, nxt = verify(gen, rows, draft, job.events.put)
        cache.truncate(base + 1 + accepted)          # t and the accepted draft tokens
        self.costs.record(1 + len(draft), took)
        job.draft.update(len(draft), accepted)
        if source is not None:
            job.draft.cursor = source + accepted
        gen.drafted += len(draft)
        gen.accepted += accepted
        self.spec["drafted"] += len(draft)
        self.spec["accepted"] += accepted
        if gen.done:
            self._end(job, gen.finish())
        elif nxt is None:
            job.logits = rows[len(draft)]             # every draft token held: sample after the last
        else:
            job.carry = nxt.id                        # the correction runs with the next draft
        return True
