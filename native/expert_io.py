"""Reads of experts into cache slots on a few I/O threads, the most urgent first.

The disk is one pipe (bench/moe_stream.py: random O_DIRECT reads of an expert projection reach
~93 % of the best throughput at one in flight and all of it at four), so what matters is the
order: a read the forward is waiting for (DEMAND) goes before a guess for a later layer (AHEAD),
which goes before filling free slots (FILL). A guess its layer did not choose is cancelled if
its reads have not started — it would only take the disk from the next layer's misses — and a
guess the layer did choose is moved to the front.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Callable

DEMAND, AHEAD, FILL = 0, 1, 2


class ReadCancelled(Exception):
    """An expert read cancelled before all of its parts were read."""


class ReadPool:
    """Worker threads taking tasks from a priority queue (lowest first, then in order)."""

    def __init__(self, threads: int, name: str = "kiln-expert-io"):
        self.queue: queue.PriorityQueue = queue.PriorityQueue()
        self.order = itertools.count()
        self.threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                        for i in range(max(1, threads))]
        for t in self.threads:
            t.start()

    def submit(self, priority: int, task: Callable[[], None]) -> None:
        self.queue.put((priority, next(self.order), task))

    def _run(self) -> None:
        while True:
            _, _, task = self.queue.get()
            if task is None:
                return
            task()

    def close(self) -> None:
        for _ in self.threads:
            self.queue.put((1 << 30, next(self.order), None))
        for t in self.threads:
            t.join()


class ExpertRead:
    """One expert's projections read into its slot, each part its own task so they can be in
    flight together. `future` completes once no part is running any more: with finish()'s
    result, or the first part's error, or ReadCancelled — never while a part may still write
    into the slot, so the slot can be reused as soon as the future is done."""

    def __init__(self, pool: ReadPool, priority: int, parts: list[Callable[[], None]], finish: Callable):
        self.future: Future = Future()
        self.parts, self.finish, self.priority = parts, finish, priority
        self.lock = threading.Lock()
        self.todo = set(range(len(parts)))        # parts no thread has taken yet
        self.left = len(parts)                    # parts not finished (taken or not)
        self.cancelled, self.error = False, None
        for i in range(len(parts)):
            pool.submit(priority, functools.partial(self._part, i))

    @property
    def started(self) -> bool:
        return len(self.todo) < len(self.parts)

    def _part(self, i: int) -> None:
        with self.lock:
            if i not in self.todo:                # an earlier copy (see hurry) took it
                return
            self.todo.discard(i)
            skip = self.cancelled or self.error is not None
        err = None
        if not skip:
            try:
                self.parts[i]()
            except BaseException as exc:          # noqa: BLE001 — handed to the waiter
                err = exc
        with self.lock:
            self.left -= 1
            last = self.left == 0
            if err is not None and self.error is None:
                self.error = err
        if last:
            self._complete()

    def _complete(self) -> None:
        if self.error is not None:
            self.future.set_exception(self.error)
        elif self.cancelled:
            self.future.set_exception(ReadCancelled())
        else:
            try:
                self.future.set_result(self.finish())
            except BaseException as exc:          # noqa: BLE001
                self.future.set_exception(exc)

    def hurry(self, pool: ReadPool, priority: int) -> None:
        """Move the parts not yet taken ahead, to `priority` (a guess that turned out needed)."""
        with self.lock:
            if priority >= self.priority or self.cancelled:
                return
            self.priority = priority
            waiting = sorted(self.todo)
        for i in waiting:
            pool.submit(priority, functools.partial(self._part, i))

    def cancel(self) -> list[int]:
        """Skip the parts not yet taken; returns the parts that were (they run to the end)."""
        with self.lock:
            self.cancelled = True
            return sorted(set(range(len(self.parts))) - self.todo)
