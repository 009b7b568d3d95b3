"""A restarted expert cache starts with what its predecessor held.

A cache in the supervisor's segment survives a worker's crash as it is (native/experts/memory.py);
a cache in the worker's own memory (the default where shared memory takes no huge pages) does
not, and neither does any cache across `kiln down` / `kiln up`. So the cache keeps a list of its
resident experts, hottest first by its own policy (`hot`, refreshed on the forward's thread at
most every HOT_EVERY seconds), the moe-stream worker writes it to its state folder, and a new
cache `preload`s it into its free slots at boot — a few seconds of reading at the disk's full
rate instead of minutes of misses at the routing's pace.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .io import FILL

HOT_EVERY = 2.0                 # seconds between two snapshots of the resident set
PRELOAD_BATCH = 32              # reads in flight while preloading (one batch past the deadline at most)


class WarmStart:
    """Mixin of ExpertCache: the hot list, and preloading one."""

    def _init_warm(self) -> None:
        self.hot: list[tuple[int, int]] = []     # replaced whole (read by the status thread)
        self.hot_version = 0
        self._hot_at = float("-inf")
        self.preloaded = 0                       # experts read at boot from a predecessor's list

    def _note_hot(self) -> None:
        """On the forward's thread, at a token's first layer: snapshot the resident set."""
        now = time.monotonic()
        if now - self._hot_at >= HOT_EVERY and self.index:
            self._hot_at = now
            self.hot = self.policy.hottest_first(list(self.index))
            self.hot_version += 1

    def preload(self, keys, seconds: float) -> int:
        """Read `keys` (hottest first) into free slots for at most about `seconds`; returns how
        many became resident. Experts the model does not have, or already resident, are skipped;
        a read that fails ends the preload (the error is in `last_read_error`)."""
        known = {k[0] for k in self.map}
        want = [k for k in dict.fromkeys((int(layer), int(e)) for layer, e in keys)
                if k[0] in known and 0 <= k[1] < self.n_expert and k not in self.index]
        deadline, waited = time.monotonic() + seconds, self.wait_seconds
        done = 0
        try:
            while want and self.free and time.monotonic() < deadline:
                batch, want = want[:min(PRELOAD_BATCH, len(self.free))], want[PRELOAD_BATCH:]
                for key in batch:
                    slot = self.free.pop()
                    self.index[key] = slot
                    self._submit(key, slot, FILL)
                    self.policy.admit(key)
                for key in batch:
                    self._wait(key)
                    done += 1
        except OSError:
            self._reap()                         # the rest of the batch: resident or dropped
        finally:
            self.wait_seconds = waited           # not a stall of any forward
        self.preloaded += done
        return done


def save_hot(path: Path, model: Path, keys: list) -> None:
    """Write a cache's hot list for `model` (atomically: a crash mid-write leaves the old one)."""
    st = model.stat()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": str(model), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                               "experts": [list(k) for k in keys]}))
    os.replace(tmp, path)


def load_hot(path: Path, model: Path) -> list | None:
    """The hot list saved for this very file (same path, size and mtime), else None."""
    try:
        saved = json.loads(path.read_text())
        st = model.stat()
        if (saved["model"], saved["size"], saved["mtime_ns"]) != (str(model), st.st_size, st.st_mtime_ns):
            return None
        return [tuple(k) for k in saved["experts"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
