"""The MoE stream worker (kind `moe-stream`): an inference worker whose experts come from disk.

Non-expert weights are used from the memory-mapped GGUF as usual; the routed experts are read
with O_DIRECT into an expert cache that lives in a shared-memory segment the supervisor created
(`settings.shm`, `settings.shm_slots`). The segment outlives this process, so a restarted worker
re-attaches and finds its cache warm (every slot re-validated by CRC32). Same ops as the
inference worker; the HTTP API does not change.
"""

from __future__ import annotations

import mmap
import os

from kiln.native.expert_store import ExpertCache, ExpertStore

from .inference import InferenceWorker
from .runtime import BootError, main


class MoEStreamWorker(InferenceWorker):
    kind = "moe-stream"

    def boot(self):
        super().boot()
        if not self.model.config.is_moe:
            raise BootError(f"{self.model.path.name} is not a mixture-of-experts model; use kind = \"inference\"")
        shm, slots = self.settings.get("shm"), self.settings.get("shm_slots")
        if not shm or not slots:
            raise BootError("no expert cache segment was given (moe-stream workers are started by `kiln up`)")
        try:
            fd = os.open(shm, os.O_RDWR)
        except OSError as e:
            raise BootError(f"cannot open the expert cache segment {shm}: {e.strerror}") from None
        self.segment = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)
        os.close(fd)
        store = ExpertStore(self.model.path, direct=self.settings.get("direct", True))
        self.cache = ExpertCache(self.model.gguf, store, int(slots), buffer=self.segment)
        self.model.expert_provider = self.cache

    def status(self) -> dict:
        st = super().status()
        cache = getattr(self, "cache", None)
        if cache is not None:
            st["expert_cache"] = cache.stats()
        return st


if __name__ == "__main__":
    main(MoEStreamWorker)
