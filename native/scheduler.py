"""Continuous batching: several generations share one model, one decode step for all.

A `Scheduler` thread owns `slots` sequences (each with its own KV cache). New requests wait in
FIFO order for a free slot — the one whose cache shares the longest prefix with the prompt, so
a follow-up turn reuses its conversation — and are prefilled on admission. Then every active
request advances by one token in a single `forward_batch` step, which reads the weights once
for the whole batch. On the compiled kernels each row is bit-identical to running that request
alone, so batching never changes an answer.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .generate import ContextLengthError, Finish, Generation, Sequence
from .model import Model
from .sampling import SamplingParams


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


class Scheduler:
    def __init__(self, model: Model, n_ctx: int, slots: int = 4):
        self.model, self.n_ctx = model, n_ctx
        self.seqs = [Sequence(model, n_ctx) for _ in range(max(1, slots))]
        self.free = list(range(len(self.seqs)))
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self.cond = threading.Condition()
        self.model_lock = threading.Lock()      # other users of the model (scoring) take turns with steps
        self.thread = threading.Thread(target=self._run, name="kiln-scheduler", daemon=True)
        self.thread.start()

    # -- callers (any thread) ------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, cancelled: Callable[[], bool],
               adapter=None, n: int = 1, show: frozenset = frozenset()) -> Job:
        """Queue a generation; with n > 1, n sequences that share the prompt (prefilled once)
        and put their events, each carrying its index, on the first job's queue."""
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt) + params.max_tokens > self.n_ctx:
            raise ContextLengthError(len(prompt), params.max_tokens, self.n_ctx)
        if not 1 <= n <= len(self.seqs):
            raise ValueError(f"n = {n} sequences do not fit: this worker runs at most {len(self.seqs)} "
                             f"at once (its `parallel` setting)")
        job = Job(prompt, params, cancelled, adapter=adapter, show=show)
        job.group = [job] + [Job(prompt, params, cancelled, events=job.events, adapter=adapter, index=i, show=show)
                             for i in range(1, n)]
        with self.cond:
            self.waiting.append(job)
            self.cond.notify()
        return job

    def load(self) -> dict:
        with self.cond:
            return {"active": len(self.active), "waiting": len(self.waiting), "slots": len(self.seqs)}

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.active:
                    self.cond.wait()
                admit = []
                while self.waiting and len(self.free) >= len(self.waiting[0].group):
                    lead = self.waiting.popleft()
                    for job in lead.group:
                        job.slot = self._best_slot(job)
                        self.free.remove(job.slot)
                    admit.append(lead)
            with self.model_lock:
                for lead in admit:
                    self._admit(lead)
                    for job in lead.group[1:]:
                        self._admit(job, lead)
                self._step()

    def _best_slot(self, job: Job) -> int:
        return max(self.free, key=lambda i: (self.seqs[i].cache.common_prefix(job.prompt, job.adapter), -i))

    def _admit(self, job: Job, lead: Job | None = None) -> None:
        """Prefill `job`'s prompt — or, for a later sequence of a group, copy its lead's."""
        seq = self.seqs[job.slot]
        try:
            if job.cancelled():
                raise _Cancelled()
            job.gen = Generation(self.model, job.prompt, job.params, index=job.index, show=job.show)
            if lead is not None and lead.slot is not None and lead.logits is not None:
                seq.cache.copy_from(self.seqs[lead.slot].cache)
                job.logits, job.gen.cached = lead.logits, lead.gen.cached
            else:
                job.logits, job.gen.cached = seq.prefill(job.prompt, job.cancelled, adapter=job.adapter)
            if job.logits is None:
                return self._end(job, job.gen.finish("cancelled"))
            if job.params.max_tokens == 0:
                return self._end(job, job.gen.finish("length"))
            with self.cond:
                self.active.append(job)
        except _Cancelled:
            self._end(job, Finish("cancelled", len(job.prompt), 0, 0, index=job.index))
        except Exception as e:  # noqa: BLE001 - reported to the request, the scheduler goes on
            self._end(job, e)

    def _step(self) -> None:
        """Sample one token for every active job, then one batched forward for those going on."""
        going = []
        for job in list(self.active):
            if job.cancelled():
                self._end(job, job.gen.finish("cancelled"))
                continue
            tok = job.gen.step(job.logits)
            job.events.put(tok)
            if job.gen.done:
                self._end(job, job.gen.finish())
            else:
                going.append((job, tok.id))
        groups: dict[int, list] = {}         # one batched step per adapter (None: the base)
        for job, t in going:
            groups.setdefault(id(job.adapter), []).append((job, t))
        for group in groups.values():
            try:
                logits = self.model.forward_batch([t for _, t in group], [self.seqs[j.slot].cache for j, _ in group],
                                                  group[0][0].adapter)
            except Exception as e:  # noqa: BLE001
                for job, _ in group:
                    self._end(job, e)
                continue
            for (job, _), row in zip(group, logits):
                job.logits = row

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
