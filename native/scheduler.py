"""Continuous batching: several generations share one model, one decode step for all.

A `Scheduler` thread owns `slots` sequences (each with its own KV cache). New requests wait in
FIFO order for a free slot — the one whose cache shares the longest prefix with the prompt, so
a follow-up turn reuses its conversation, and further along from the worker's prefix cache
(native/prefix_cache.py: blocks any sequence computed, in RAM or on disk) — and are prefilled
on admission. Then every active
request advances by one token in a single `forward_batch` step, which reads the weights once
for the whole batch. On the compiled kernels each row is bit-identical to running that request
alone, so batching never changes an answer.

A prompt is prefilled in chunks between decode steps (sized to a few steps' time while others
decode), and a request decoding alone may check a draft in the same forward — a prompt-lookup
one (native/speculate.py) or a draft model's (native/draft_model.py) — neither changes a bit of
any answer.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import time

import numpy as np

from . import kernels
from .core_share import CoreShare, own_busy_of
from .draft_model import DraftModel, DraftState
from .vision.layout import whole_images
from .generate import PREFILL_CHUNK, Finish, Generation, Sequence, check_context
from .model import FUSED_RUN, Model
from .sampling import SamplingParams
from .scheduler_slots import SlotAccess
from .speculate import DraftControl, ForwardCosts, Speculation, ema

MIN_CHUNK = 4           # rows: an interleaved prefill chunk smaller than this is mostly fixed cost
DEFAULT_PARALLEL = 4    # sequences a worker decodes together (its `parallel` setting)


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    cancelled: Callable[[], bool]
    events: queue.Queue = field(default_factory=queue.Queue)   # Token … then Finish or Exception
    adapter: object = None                                      # a LoRA (native/lora.py) or None
    gen: Generation | None = None
    slot: int | None = None
    logits: object = None
    index: int = 0                                              # within its group (n > 1)
    group: list["Job"] | None = None                            # the jobs sharing this prompt
    show: frozenset = frozenset()                               # control tokens shown as text
    pos: int = 0                                                # prompt tokens in the cache so far
    draft: DraftControl | None = None                           # speculation state
    draft_state: DraftState | None = None                       # the draft model's cache, if one drafts
    carry: int | None = None        # a token chosen but not yet run (after a rejected draft)
    spans: list | None = None       # a prompt with images: its images' (first, end) attended both ways


class Scheduler(SlotAccess, Speculation):
    """`prefill_ratio`: while other requests are decoding, a prompt is prefilled in chunks that
    run in the same forward as their decode step, the chunk steered so that this forward takes
    about this many plain steps' time (measured as it runs) — so a long prompt never freezes a
    running stream. `prefill_chunk` fixes the chunk instead (run apart, between the steps)."""

    def __init__(self, model: Model, n_ctx: int, slots: int = DEFAULT_PARALLEL, prefill_ratio: float = 3.0,
                 prefill_chunk: int = 0, speculative: bool = True, threads: int | None = None,
                 draft_model: DraftModel | None = None, draft_min: int = 0, prefix=None):
        self.model, self.n_ctx = model, n_ctx
        self.prefix = prefix                    # a PrefixCache shared by the sequences, or None
        self.rounds = 0                         # loop iterations (a prompt's blocks are kept a round later)
        self.to_publish: list = []              # (round, cache) whose prompt's blocks go to the prefix cache
        self.draft_model = draft_model          # drafts from a second model, else prompt lookup
        self.draft_min = draft_min              # check at least this many draft tokens (0: as they pay)
        # compute threads: fixed when given, else as many as the cores other processes leave
        self.share = None if threads or kernels.max_threads() < 2 else \
            CoreShare(kernels.max_threads(), own=own_busy_of(model))
        self.threads = threads or (self.share.max_threads if self.share else kernels.max_threads())
        kernels.set_threads(self.threads)       # process-wide: whatever an earlier scheduler left
        model.use_context(n_ctx)
        self.seqs = [Sequence(model, n_ctx) for _ in range(max(1, slots))]
        self.free = list(range(len(self.seqs)))
        self.waiting: deque[Job] = deque()
        self.prefilling: deque[Job] = deque()
        self.active: list[Job] = []
        self.prefill_ratio, self.prefill_chunk, self.speculative = prefill_ratio, prefill_chunk, speculative
        self.step_s: float | None = None           # a decode step's time (moving average)
        self.chunk_n: float | None = None          # interleaved chunk size, steered to its time target
        self.rides = 0                              # how many steps did (load() reports it)
        self.spec = {"drafted": 0, "accepted": 0}
        self.costs = ForwardCosts()                 # forward time by row count (speculation's costs)
        self.kept = DraftControl()                  # what drafts kept lately, over all requests
        self.cond = threading.Condition()
        self.model_lock = threading.Lock()      # other users of the model (scoring) take turns with steps
        self.thread = threading.Thread(target=self._run, name="kiln-scheduler", daemon=True)
        self.thread.start()

    # -- callers (any thread) ------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, cancelled: Callable[[], bool],
               adapter=None, n: int = 1, show: frozenset = frozenset()) -> Job:
        """Queue a generation; with n > 1, n sequences that share the prompt (prefilled once)
        and put their events, each carrying its index, on the first job's queue."""
        check_context(prompt, params, self.n_ctx, self.seqs[0].cache.can_shift and self.model.can_shift_over(prompt))
        if not 1 <= n <= len(self.seqs):
            raise ValueError(f"n = {n} sequences do not fit: this worker runs at most {len(self.seqs)} "
                             f"at once (its `parallel` setting)")
        spans = self.model.media.spans(np.asarray(prompt)) if min(prompt, default=0) < 0 else None
        job = Job(prompt, params, cancelled, adapter=adapter, show=show, spans=spans)
        job.group = [job] + [Job(prompt, params, cancelled, events=job.events, adapter=adapter, index=i, show=show,
                                 spans=spans) for i in range(1, n)]
        with self.cond:
            self.waiting.append(job)
            self.cond.notify()
        return job

    def load(self) -> dict:
        with self.cond:
            return {"active": len(self.active), "prefilling": len(self.prefilling), "waiting": len(self.waiting),
                    "slots": len(self.seqs), "speculative": dict(self.spec), "threads": self.threads,
                    "prefill_rides": self.rides,
                    "prefix_cache": self.prefix.stats() if self.prefix is not None else None,
                    "other_processes_cores": round(self.share.others, 2) if self.share else None}

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.cond:
                idle = False
                while not self.waiting and not self.active and not self.prefilling:
                    idle = True
                    self.cond.wait()
                if idle and self.share is not None:
                    self.share.resume()
                admit = []
                while self.waiting and len(self.free) >= len(self.waiting[0].group):
                    lead = self.waiting.popleft()
                    for job in lead.group:
                        job.slot = self._best_slot(job)
                        self.free.remove(job.slot)
                    admit.append(lead)
            if self.share is not None and self.share.threads() != self.threads:
                self.threads = self.share.current
                kernels.set_threads(self.threads)
            with self.model_lock:
                try:
                    for lead in admit:
                        self._start(lead)
                    if not self._step():          # a step that carried a chunk was this round's prefill
                        self._prefill_some()
                    self._publish_due()
                except Exception as e:  # noqa: BLE001 - a fault of ours must not hang every request
                    self._fail_all(admit, e)

    def _fail_all(self, admit: list[Job], e: Exception) -> None:
        """An unexpected error outside a forward (the forwards fail only their own requests): end
        every request under way with it, forget the caches they were writing (a half-run step
        may have left them inconsistent), and go on serving."""
        err = RuntimeError(f"internal error in the scheduler ({type(e).__name__}: {e}); the request was "
                           f"stopped, the worker goes on serving — please report this")
        jobs = {id(j): j for lead in admit + list(self.prefilling) for j in lead.group}
        jobs.update({id(j): j for j in self.active})
        self.prefilling.clear()
        for job in jobs.values():
            if job.slot is not None:
                self.seqs[job.slot].cache.truncate(0)
            if job.slot is not None or job in self.active:
                self._end(job, err)

    def _best_slot(self, job: Job) -> int:
        return max(self.free, key=lambda i: (self.seqs[i].cache.common_prefix(job.prompt, job.adapter), -i))

    def _start(self, job: Job) -> None:
        """Reuse the slot's cached prefix and queue the rest of the prompt for prefill."""
        try:
            if job.cancelled():
                raise _Cancelled()
            job.gen = Generation(self.model, job.prompt, job.params, index=job.index, show=job.show)
            seq = self.seqs[job.slot]
            job.pos = job.gen.cached = self._from_prefix_cache(seq.cache, job.prompt, seq.start(job.prompt, job.adapter))
            self.prefilling.append(job)
        except _Cancelled:
            self._end_group(job, None)
        except Exception as e:  # noqa: BLE001 - reported to the request, the scheduler goes on
            self._end_group(job, e)

    def _from_prefix_cache(self, cache, prompt: list[int], reuse: int) -> int:
        prefix = self.prefix
        if prefix is None:
            return reuse
        try:
            return prefix.extend(cache, prompt, reuse)
        except Exception as e:  # noqa: BLE001 - a cache's fault costs a prefill, never the request
            prefix.log(f"reading cached blocks failed ({type(e).__name__}: {e}); the prompt is computed instead")
            cache.truncate(0)
            return 0

    def _publish_due(self) -> None:
        """Keep the blocks of prompts prefilled before this round's step — after it, so that a
        prompt's first token never waits for its copy into the prefix cache."""
        self.rounds += 1
        prefix = self.prefix
        if prefix is None:
            self.to_publish.clear()
            return
        idle = not (self.active or self.prefilling or self.waiting)     # nothing waits: all of them now
        due = [c for r, c in self.to_publish if idle or r < self.rounds - 1]
        self.to_publish = [(r, c) for r, c in self.to_publish if not idle and r >= self.rounds - 1]
        for cache in due:
            try:
                prefix.publish(cache)
            except Exception as e:  # noqa: BLE001
                prefix.log(f"keeping the prompt's blocks failed ({type(e).__name__}: {e})")

    def _prefill_budget(self) -> int:
        if not self.active:
            return PREFILL_CHUNK                  # nobody waits on us: big chunks, fastest
        if self.prefill_chunk:
            return self.prefill_chunk
        if self.chunk_n is None:
            self.chunk_n = float(self._first_chunk())
        return int(self.chunk_n)

    def _first_chunk(self) -> int:
        """The first interleaved chunk: the most rows whose forward is expected (measured, or
        guessed from the sizes measured) to take at most prefill_ratio decode steps — a fixed
        first guess stalled the stream when the machine is slower than the guess assumed."""
        n = 1
        while n < PREFILL_CHUNK and (r := self.costs.ratio(n + 1)) is not None and r <= self.prefill_ratio:
            n += 1
        return max(MIN_CHUNK, n)

    def _prefill_some(self) -> None:
        budget = self._prefill_budget()
        interleaved = bool(self.active)
        while self.prefilling and budget > 0:
            job = self.prefilling[0]
            if job.cancelled():
                self.prefilling.popleft()
                self._end_group(job, None)
                continue
            n = whole_images(job.spans, job.pos, min(budget, len(job.prompt) - job.pos))
            t0 = time.perf_counter()
            try:
                logits = self.model.forward(job.prompt[job.pos:job.pos + n], self.seqs[job.slot].cache,
                                            adapter=job.adapter)
            except Exception as e:  # noqa: BLE001
                self.prefilling.popleft()
                self._end_group(job, e)
                continue
            if interleaved and self.step_s and not self.prefill_chunk:
                self._steer(n, time.perf_counter() - t0)
            job.pos += n
            budget -= n
            if job.pos >= len(job.prompt):
                self.prefilling.popleft()
                self._prefilled(job, logits)

    def _prefilled(self, job: Job, logits: np.ndarray) -> None:
        job.logits = logits
        if job.slot is not None:                 # recurrent layers: their states at the prompt's end
            self.seqs[job.slot].cache.checkpoint()
        if job.slot is not None and self.prefix is not None:
            self.to_publish.append((self.rounds, self.seqs[job.slot].cache))
        self._ready(job)
        for follower in job.group[1:]:
            self._follow(follower, job)

    def _steer(self, n: int, took: float) -> None:
        """Steer the chunk so that a forward with it takes prefill_ratio decode steps (its cost is
        not proportional to its size: a forward has a fixed part), damped."""
        scale = (self.prefill_ratio * self.step_s / took) ** 0.5
        self.chunk_n = max(float(MIN_CHUNK), min(float(PREFILL_CHUNK), n * scale))

    def _rider(self) -> Job | None:
        """The prompt whose next chunk runs in this decode step's forward, if any: interleaved
        prefill (a fixed prefill_chunk keeps chunks apart), once a plain step has been timed."""
        if self.prefill_chunk or self.step_s is None or not self.prefilling or self.prefilling[0].cancelled():
            return None
        return self.prefilling[0]

    def _follow(self, job: Job, lead: Job) -> None:
        """A later sequence of a group: a copy of its lead's prefilled cache."""
        try:
            if job.cancelled() or lead.slot is None:
                raise _Cancelled()
            job.gen = Generation(self.model, job.prompt, job.params, index=job.index, show=job.show)
            self.seqs[job.slot].cache.copy_from(self.seqs[lead.slot].cache)
            job.logits, job.gen.cached = lead.logits, lead.gen.cached
            self._ready(job)
        except _Cancelled:
            self._end(job, Finish("cancelled", len(job.prompt), 0, 0, index=job.index))
        except Exception as e:  # noqa: BLE001
            self._end(job, e)

    def _ready(self, job: Job) -> None:
        if job.params.max_tokens == 0:
            return self._end(job, job.gen.finish("length"))
        with self.cond:
            self.active.append(job)

    def _step(self) -> bool:
        """Sample one token for every active job, then one batched forward for those going on
        (or, for a job decoding alone, a forward that also checks a prompt-lookup draft). True
        when a prompt's chunk rode in the forward."""
        going = []
        for job in list(self.active):
            if job.cancelled():
                self._end(job, job.gen.finish("cancelled"))
                continue
            if job.carry is not None:          # chosen last step (already sent): run it now
                t, job.carry = job.carry, None
            else:
                tok = job.gen.step(job.logits)
                job.events.put(tok)
                if job.gen.done:
                    self._end(job, job.gen.finish())
                    continue
                t = tok.id
            try:                               # at the context's end: shift it, or stop there
                room = job.gen.shift(self.model, self.seqs[job.slot].cache, self.n_ctx)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the worker's
                self._end(job, e)
                continue
            if room:
                going.append((job, t))
            else:
                self._end(job, job.gen.finish("length"))
        rider = self._rider() if going else None
        if rider is None and len(going) == 1 and self._speculate(*going[0]):
            return False
        rode = False
        # one batched step for every sequence, each with its own adapter (or none): the rows of
        # different adapters share the base products, each adds its own low-rank ones
        for group in ([going] if going else []):
            runs = [([t], self.seqs[j.slot].cache) for j, t in group]
            adapters = [j.adapter for j, _ in group]
            # a prompt being prefilled rides along: its next chunk in the same forward, so a
            # running stream waits for one forward of a few more rows, not a chunk and a step
            ride = rider
            n = whole_images(ride.spans, ride.pos, min(self._prefill_budget(), FUSED_RUN, len(ride.prompt) - ride.pos)) \
                if ride else 0
            if ride:
                runs.append((ride.prompt[ride.pos:ride.pos + n], self.seqs[ride.slot].cache))
                adapters.append(ride.adapter)
                rider = None
            t0 = time.perf_counter()
            try:
                logits = self.model.forward_runs(runs, adapters)
            except Exception as e:  # noqa: BLE001
                for job, _ in group:
                    self._end(job, e)
                if ride:
                    self.prefilling.remove(ride)
                    self._end_group(ride, e)
                continue
            took = time.perf_counter() - t0
            self.costs.record(len(group) + n, took)
            if ride:
                self._steer(n, took)
                self.rides += 1
                rode = True
            else:
                self.step_s = ema(self.step_s, took)
            for (job, _), row in zip(group, logits):
                job.logits = row
            if ride:
                ride.pos += n
                if ride.pos >= len(ride.prompt):
                    self.prefilling.remove(ride)
                    self._prefilled(ride, logits[-1])
        return rode

    def _end_group(self, job: Job, error) -> None:
        for j in job.group or [job]:
            if error is None:
                self._end(j, j.gen.finish("cancelled") if j.gen else Finish("cancelled", len(j.prompt), 0, 0,
                                                                             index=j.index))
            else:
                self._end(j, error)

    def _end(self, job: Job, final) -> None:
        job.events.put(final)
        with self.cond:
            if job in self.active:
                self.active.remove(job)
            if job.slot is not None and job.slot not in self.free:
                self.free.append(job.slot)
            job.slot = None


class _Cancelled(Exception):
    pass

