"""Model plans computed once per file version, off the supervisor's loop.

Planning reads a GGUF header (every count bounded by the reader, but still file I/O and parsing).
The loop must never do it: a slow disk or a hostile file would hold every worker's heartbeats and
every request. So a request's model is planned on the thread that received it (an HTTP thread, or
the off-loop pool for the control socket) — `Placer.prepare` — and the loop's placement finds the
plan, or the file's error, here.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Callable


class PlanCache:
    def __init__(self, plan: Callable[..., dict], size: int = 64):
        self.plan, self.size = plan, size
        self.lock = threading.Lock()
        self.entries: OrderedDict[tuple, dict | Exception] = OrderedDict()

    @staticmethod
    def _key(path, ctx, parallel, draft, budget, kv, mmproj=None) -> tuple:
        st = os.stat(path)             # a changed file (same name, new bytes) is planned again
        return (os.path.realpath(path), st.st_size, st.st_mtime_ns, ctx, parallel, str(draft) if draft else None,
                budget, tuple(kv), str(mmproj) if mmproj else None)

    def __call__(self, path, ctx=None, parallel=None, draft=None, budget=None, kv=("f16", "f16"), mmproj=None) -> dict:
        key = self._key(path, ctx, parallel, draft, budget, kv, mmproj)
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None:
                self.entries.move_to_end(key)
        if hit is None:
            try:
                hit = self.plan(path, ctx, parallel=parallel, draft=draft, budget=budget, kv=tuple(kv),
                                **({"mmproj": mmproj} if mmproj else {}))
            except Exception as e:  # noqa: BLE001 - a file's error is remembered as its answer
                hit = e
            with self.lock:
                self.entries[key] = hit
                while len(self.entries) > self.size:
                    self.entries.popitem(last=False)
        if isinstance(hit, Exception):
            raise hit.with_traceback(None)
        return dict(hit)
