"""Reads of experts into cache slots on a few I/O threads, the most urgent first.

The disk is one pipe (bench/moe_stream.py: random O_DIRECT reads of an expert projection reach
~93 % of the best throughput at one in flight and all of it at four), so what matters is the
order: a read the forward is waiting for (DEMAND) goes before a guess for a later layer (AHEAD),
which goes before filling free slots (FILL). Each read is cut into chunks, so a needed read
overtakes a guess within a chunk. A guess its layer did not choose is cancelled — its chunks not
yet read are skipped — and a guess the layer did choose is moved to the front.

The threads are C (native/_reader.c: they never take the GIL, which a finished read on a Python
thread waited for while the forward ran Python); without the compiled module, `ThreadReader`
does the same on Python threads. Completions are collected on the forward's thread (`ReadQueue`),
which also finishes each read (index entry, views) — no other thread touches the cache.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import os
import threading
import time
from typing import Callable

DEMAND, AHEAD, FILL = 0, 1, 2
# a needed read waits at most this much of a guess per thread; whole 884 KiB projections read
# ~5 % faster than 512 KiB halves (one expert in flight, into huge pages), 256 KiB ~10 % slower
CHUNK_BYTES = 1 << 20
DEPTHS = 8                   # stats: seconds with 1, 2, ... 8-or-more chunks in flight (as _reader.c)
# a read's offset: a split model's part number above bit 44, the offset in that file below (as _reader.c)
PART_SHIFT = 44
PART_MASK = (1 << PART_SHIFT) - 1


class ReadCancelled(Exception):
    """An expert read cancelled before all of its parts were read."""


def compiled_reader():
    try:
        from .. import _reader
    except ImportError:
        return None
    return _reader.Reader


class ThreadReader:
    """native/_reader.c's Reader on Python threads (the same interface and semantics), for an
    install without the compiled module."""

    def __init__(self, threads: int, fd: int, buffered: bool, slots: int, max_chunks: int, chunk_bytes: int):
        self.fds = [fd] if isinstance(fd, int) else list(fd)          # one file, or a split model's parts
        self.buffered, self.max_chunks, self.chunk_bytes = buffered, max_chunks, chunk_bytes
        self.mu = threading.Condition()
        self.done_cv = threading.Condition(self.mu)
        self.heap: list = []
        self.seq = itertools.count()
        self.reads: dict[int, dict] = {}
        self.gen = [0] * slots
        self.done: list = []
        self.faults: list = []
        self.bytes, self.busy, self.inflight, self.busy_since, self.stop = 0, 0.0, 0, 0.0, False
        self.depth, self.depth_since = [0.0] * DEPTHS, 0.0
        self.threads = [threading.Thread(target=self._run, name=f"kiln-expert-io-{i}", daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def submit(self, slot: int, prio: int, parts) -> int:
        chunks = [[off + at, min(self.chunk_bytes, size - at), max(0, min(self.chunk_bytes, need - at)), dest + at, False]
                  for off, size, need, dest in parts for at in range(0, size, self.chunk_bytes)]
        if len(chunks) > self.max_chunks:
            raise ValueError(f"a read of more than {self.max_chunks} chunks")
        with self.mu:
            if self.reads.get(slot, {}).get("active"):
                raise RuntimeError(f"slot {slot} has a read in flight")
            self.gen[slot] += 1
            rd = self.reads[slot] = {"active": True, "gen": self.gen[slot], "left": len(chunks), "cancelled": False,
                                     "err": 0, "err_at": -1, "prio": prio, "chunks": chunks}
            for c in chunks:
                heapq.heappush(self.heap, (prio, next(self.seq), slot, rd["gen"], c))
            if not chunks:
                rd["left"] = 1
                self._finished(slot, 1)
            self.mu.notify_all()
        return self.gen[slot]

    def hurry(self, slot: int, prio: int) -> int:
        with self.mu:
            rd = self.reads.get(slot)
            if not rd or not rd["active"] or rd["cancelled"] or prio >= rd["prio"]:
                return 0
            rd["prio"] = prio
            moved = [c for c in rd["chunks"] if not c[4]]
            for c in moved:
                heapq.heappush(self.heap, (prio, next(self.seq), slot, rd["gen"], c))
            self.mu.notify_all()
            return len(moved)

    def cancel(self, slot: int) -> int:
        with self.mu:
            rd = self.reads.get(slot)
            if not rd or not rd["active"] or rd["cancelled"]:
                return 0
            rd["cancelled"] = True
            skipped = self._skip_untaken(rd)
            if skipped:
                self._finished(slot, skipped)
            return len(rd["chunks"]) - skipped

    def poll(self, timeout: float) -> list:
        with self.mu:
            if not self.done and timeout > 0:
                self.done_cv.wait_for(lambda: self.done, timeout)
            out, self.done = self.done, []
            return out

    def stats(self) -> dict:
        with self.mu:
            t = time.perf_counter()
            busy = self.busy + (t - self.busy_since if self.inflight else 0)
            depth = list(self.depth)
            if self.inflight:
                depth[min(self.inflight, DEPTHS) - 1] += t - self.depth_since
            return {"bytes": self.bytes, "busy_seconds": busy, "chunks_in_flight": self.inflight,
                    "chunks_queued": len(self.heap), "depth_seconds": depth}

    def _depth_changes(self, by: int) -> None:
        """Under mu: the time at the old depth is over (as _reader.c's depth_changes)."""
        t = time.perf_counter()
        if self.inflight:
            self.depth[min(self.inflight, DEPTHS) - 1] += t - self.depth_since
        else:
            self.busy_since = t
        self.depth_since = t
        self.inflight += by
        if not self.inflight:
            self.busy += t - self.busy_since

    def set_fd(self, fd, buffered: bool) -> None:
        with self.mu:
            self.fds, self.buffered = ([fd] if isinstance(fd, int) else list(fd)), buffered

    def fault(self, *spec) -> None:
        with self.mu:
            if not spec:
                self.faults = []
            else:
                start, end, err, delay, direct_only = (*spec, 0, 0, 0, False)[:5]
                self.faults.append((start, end, err, delay, direct_only))
            self.mu.notify_all()

    def _faults_at(self, c, buffered: bool) -> list:
        off, size = c[0], c[1]
        return [f for f in self.faults if off < f[1] and f[0] < off + size and not (f[4] and buffered)]

    def close(self) -> None:
        with self.mu:
            self.stop, self.faults = True, []
            self.mu.notify_all()
        for t in self.threads:
            t.join()

    def _skip_untaken(self, rd) -> int:
        n = 0
        for c in rd["chunks"]:
            if not c[4]:
                c[4], n = True, n + 1
        return n

    def _finished(self, slot: int, n: int) -> None:
        rd = self.reads[slot]
        rd["left"] -= n
        if rd["left"] > 0:
            return
        rd["active"] = False
        self.done.append((slot, rd["gen"], rd["err"] or (errno.ECANCELED if rd["cancelled"] else 0), rd["err_at"]))
        self.done_cv.notify_all()

    def _run(self) -> None:
        with self.mu:
            while True:
                self.mu.wait_for(lambda: self.stop or self.heap)
                if self.stop:
                    return
                _, _, slot, gen, c = heapq.heappop(self.heap)
                if c[4] or self.gen[slot] != gen:
                    continue
                c[4] = True
                self._depth_changes(1)
                part = c[0] >> PART_SHIFT
                fd, buffered = (self.fds[part] if part < len(self.fds) else -1), self.buffered
                while any(f[3] < 0 for f in self._faults_at(c, buffered)):
                    self.mu.wait()                    # held until the faults are cleared
                faults = self._faults_at(c, buffered)
                self.mu.release()
                try:
                    got, err, err_at = self._read(c, fd, buffered, faults)
                finally:
                    self.mu.acquire()
                self.bytes += got
                self._depth_changes(-1)
                rd, n = self.reads[slot], 1
                if err and not rd["err"]:
                    rd["err"], rd["err_at"] = err, err_at
                    n += self._skip_untaken(rd)
                self._finished(slot, n)

    @staticmethod
    def _read(c, fd: int, buffered: bool, hit) -> tuple[int, int, int]:
        off, size, need, dest, _ = c
        delay = max((f[3] for f in hit), default=0)
        if delay:
            time.sleep(delay)                     # a slow disk, simulated
        err = next((f[2] for f in hit if f[2]), 0)
        if err:
            return 0, err, off
        import ctypes
        buf = (ctypes.c_char * size).from_address(dest)
        got, at = 0, off & PART_MASK
        try:
            while got < size:
                n = os.preadv(fd, [memoryview(buf)[got:]], at + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            return got, e.errno or errno.EIO, off + got
        if got < need:
            return got, errno.EIO, off + got
        if buffered and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, at, size, os.POSIX_FADV_DONTNEED)
        return got, 0, -1


class ExpertRead:
    """One expert's read into its slot, as the forward's thread sees it: `done()`, `result()`
    and `exception()` as a future's — done only once no chunk may still write into the slot —
    `hurry` and `cancel`."""

    def __init__(self, queue: "ReadQueue", slot: int, priority: int, parts, finish: Callable, describe: Callable):
        self.queue, self.slot, self.priority = queue, slot, priority
        self.parts, self.finish, self.describe = parts, finish, describe
        self.completed, self._value, self._error, self.retried, self.cancelled = False, None, None, False, False
        self.gen = queue.reader.submit(slot, priority, parts)

    def done(self) -> bool:
        if not self.completed:
            self.queue.collect(0.0)
        return self.completed

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.queue.wait(self, timeout)
        return self._error

    def result(self, timeout: float | None = None):
        if self.exception(timeout) is not None:
            raise self._error
        return self._value

    def hurry(self, priority: int) -> None:
        """Move the chunks not yet read ahead, to `priority` (a guess that turned out needed)."""
        if priority < self.priority and not self.completed:
            self.priority = priority
            self.queue.reader.hurry(self.slot, priority)

    def cancel(self) -> int:
        """Skip the chunks not yet read; returns how many had started (they run to the end)."""
        if self.completed:
            return 0
        self.cancelled = True
        return self.queue.reader.cancel(self.slot)


class ReadQueue:
    """The reader (C, or Python threads) and the reads in flight, by slot; completions are
    collected — and their reads finished — on the caller's thread."""

    def __init__(self, store, threads: int, slots: int, max_chunks: int, chunk_bytes: int = CHUNK_BYTES,
                 python: bool = False):
        self.store = store
        cls = None if python else compiled_reader()
        self.kind = "compiled" if cls is not None else "python"
        self.reader = (cls or ThreadReader)(max(1, threads), store.fds, store.io_mode == "buffered", slots,
                                            max_chunks, chunk_bytes)
        self.inflight: dict[int, ExpertRead] = {}

    def submit(self, slot: int, priority: int, parts, finish: Callable, describe: Callable) -> ExpertRead:
        """parts: [(file offset, size, bytes needed, destination address)], offsets, sizes and
        addresses aligned as O_DIRECT needs; finish() -> the read's result; describe(offset,
        message) -> the error a failure at that offset is reported as."""
        read = self.inflight[slot] = ExpertRead(self, slot, priority, parts, finish, describe)
        return read

    def collect(self, timeout: float) -> None:
        """Take the completions there are (waiting up to `timeout` s for one) and finish them."""
        for slot, gen, err, err_at in self.reader.poll(timeout):
            read = self.inflight.get(slot)
            if read is None or read.gen != gen:
                continue
            if err == errno.EINVAL and not read.retried and not read.cancelled:
                # O_DIRECT refused at read (tmpfs, overlayfs): on to buffered reads, once
                if self.store.io_mode == "direct":
                    self.store.to_buffered("O_DIRECT refused at read (EINVAL)")
                    self.reader.set_fd(self.store.fds, True)
                read.retried = True
                read.gen = self.reader.submit(slot, read.priority, read.parts)
                continue
            del self.inflight[slot]
            read.completed = True
            if err == errno.ECANCELED or read.cancelled:        # a cancelled read's error is moot
                read._error = ReadCancelled()
            elif err:
                read._error = read.describe(err_at, OSError(err, os.strerror(err)))
            else:
                try:
                    read._value = read.finish()
                except BaseException as exc:      # noqa: BLE001 — handed to the waiter
                    read._error = exc

    def wait(self, read: ExpertRead, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not read.completed:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the read into slot {read.slot} has not completed in {timeout} s")
            self.collect(min(left, 1.0))

    def wait_any(self, reads) -> None:
        """Until one of `reads` is done."""
        while not any(r.completed for r in reads):
            self.collect(1.0)

    def stats(self) -> dict:
        return self.reader.stats()

    def close(self) -> None:
        self.reader.close()
