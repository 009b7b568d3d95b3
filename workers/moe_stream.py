"""The MoE stream worker (kind `moe-stream`): an inference worker whose experts come from disk.

Non-expert weights are used from the memory-mapped GGUF as usual; the routed experts are read
with O_DIRECT into an expert cache of `settings.cache_slots` slots (`cache_bytes`, sized by the
supervisor) that lives in a shared-memory segment the supervisor created (`settings.shm`) — the
segment outlives this process, so a restarted worker re-attaches and finds its cache warm (every
slot re-validated by CRC32) — or, where shared memory cannot have huge pages and private memory
can, in this process's own memory, where the disk reads ~1.5x faster (`cache_memory`:
native/expert_memory.py; the supervisor makes no segment then). A cache that did not survive
(private memory, or a new daemon) preloads the experts its predecessor held, hottest first, from
the hot list this worker keeps in the state folder (native/expert_warm.py). Same ops as the
inference worker; the HTTP API does not change.
"""

from __future__ import annotations

import os
import time

import psutil

from kiln.native.experts.cache import ExpertCache
from kiln.native.experts.memory import place, private_buffer, shared_buffer
from kiln.native.experts.store import ExpertStore, expert_map
from kiln.native.experts.warm import load_hot, save_hot
from kiln.native.gguf_file import read_gguf

from .inference import InferenceWorker
from .runtime import main
from .worker import BootError, state_dir

PRELOAD_SECONDS = 3.0        # at most this much of a boot reads the predecessor's hot experts
SAVE_EVERY = 2.0             # seconds between two writes of the hot list (on heartbeats)


class MoEStreamWorker(InferenceWorker):
    kind = "moe-stream"

    def boot(self):
        self.rss_before_model = psutil.Process().memory_info().rss     # the Python runtime alone
        super().boot()
        if not getattr(self.model.config, "is_moe", False):
            raise BootError(f"{self.model.path.name} is not a mixture-of-experts model; use kind = \"inference\"")
        shm, slots, size = (self.settings.get(k) for k in ("shm", "cache_slots", "cache_bytes"))
        if self.settings.get("cache_error"):
            raise BootError(f"the expert cache cannot be made: {self.settings['cache_error']}")
        if not slots or not size:
            raise BootError("the expert cache was not sized (moe-stream workers are started by `kiln up`; "
                            "its events say why the cache could not be made)")
        try:
            placement = place(self.settings.get("cache_memory", "auto"), shm)
        except ValueError as e:
            raise BootError(str(e)) from None
        if placement.warm_restart and not (os.path.exists(shm) and os.path.getsize(shm) >= size):
            raise BootError(f"cannot open the expert cache segment {shm}: it does not exist or is too small")
        try:
            # the segment survives a crash (a warm restart); private memory takes huge pages
            # where shared memory cannot (native/expert_memory.py says which and why)
            self.segment = shared_buffer(shm, placement.huge_pages) if placement.warm_restart \
                else private_buffer(int(size), placement.huge_pages)
        except OSError as e:
            raise BootError(f"cannot map the expert cache {shm or 'memory'}: {e.strerror}") from None
        store = ExpertStore(self.model.path, direct=self.settings.get("direct", True), parts=self.model.gguf.parts)
        try:
            self.cache = ExpertCache(self.model.gguf, store, int(slots), buffer=self.segment,
                                     policy=self.settings.get("cache_policy", "lrfu"), placement=placement)
        except ValueError as e:
            raise BootError(str(e)) from None
        self.model.expert_provider = self.cache
        # a cache that did not survive (private memory, or a new daemon) starts with the experts
        # its predecessor held (native/expert_warm.py)
        self.hot_file = state_dir() / "expert-cache" / f"{self.name}.json"
        hot = load_hot(self.hot_file, self.model.path)
        if hot:
            self.cache.preload(hot, PRELOAD_SECONDS)
        self.saved_version, self.saved_at = self.cache.hot_version, 0.0
        experts = {s.name for s in expert_map(self.model.gguf).values()}
        self.non_expert_bytes = sum(t.n_bytes for n, t in self.model.gguf.tensors.items() if n not in experts)
        self.rss_after_boot = psutil.Process().memory_info().rss   # + tokenizer, template, mappings

    def keep_mapped(self, path) -> set[str]:
        """The experts stay in the mapping with weights = "private": the expert cache reads them."""
        return {s.name for s in expert_map(read_gguf(path, skip_arrays=True)).values()}

    def _save_hot(self, force: bool = False) -> None:
        cache = self.cache
        now = time.monotonic()
        if cache.hot_version != self.saved_version and (force or now - self.saved_at >= SAVE_EVERY):
            self.saved_version, self.saved_at = cache.hot_version, now
            try:
                save_hot(self.hot_file, self.model.path, cache.hot)
            except OSError:
                pass                             # only a slower start next time

    def on_stop(self) -> None:
        if getattr(self, "cache", None) is not None:
            self._save_hot(force=True)
        super().on_stop()

    def status(self) -> dict:
        st = super().status()
        cache = getattr(self, "cache", None)
        if cache is not None:
            self._save_hot()                     # heartbeats are this worker's clock
            st["expert_cache"] = cache.stats()
            st["memory"] = {"rss_before_model": self.rss_before_model, "rss_after_boot": self.rss_after_boot,
                            "non_expert_bytes": self.non_expert_bytes,
                            "cache_bytes": len(self.segment),
                            "kv_cache_bytes": sum(s.cache.nbytes for s in self.scheduler.seqs)}
        return st


if __name__ == "__main__":
    main(MoEStreamWorker)
