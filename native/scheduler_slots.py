"""A scheduler's slots as llama-server's /slots routes reach them (workers/slots.py): listed, a
slot's rows taken out to be saved, rows put back, a slot emptied — each only while no request is
using that slot, under the scheduler's model lock (no step runs meanwhile)."""

from __future__ import annotations

import numpy as np


class SlotError(ValueError):
    """A slot action that cannot be done now or on this cache (said to the caller)."""


class SlotAccess:
    """Mixed into native/scheduler.py's Scheduler: its seqs, free, cond and model_lock."""

    def slots_info(self) -> list[dict]:
        with self.cond:
            return [{"id": i, "is_processing": i not in self.free, "tokens_cached": s.cache.n}
                    for i, s in enumerate(self.seqs)]

    def _idle(self, i: int):
        """Slot i's cache, when no request is using it (the caller holds model_lock and cond)."""
        if i not in self.free:
            raise SlotError(f"slot {i} is processing a request; try again when it is idle")
        return self.seqs[i].cache

    def slot_rows(self, i: int) -> tuple[list[int], np.ndarray]:
        """The tokens and rows of slot i's plainly computed positions (kv_cache.py export_rows)."""
        with self.model_lock, self.cond:
            cache = self._idle(i)
            if cache.adapter is not None or not cache.can_rewind:
                raise SlotError(f"slot {i} cannot be saved: it holds a LoRA adapter's keys or this model's "
                                f"cache drops positions (sliding-window or recurrent layers)")
            return list(cache.tokens[:cache.exact]), cache.export_rows(0, cache.exact)

    def slot_restore(self, i: int, tokens: list[int], payload: np.ndarray) -> None:
        with self.model_lock, self.cond:
            cache = self._idle(i)
            if not cache.can_rewind:
                raise SlotError("this model's cache drops positions (sliding-window or recurrent layers): "
                                "a slot cannot be restored into it")
            cache.truncate(0)
            cache.adapter = None
            cache.import_rows(tokens, payload)

    def slot_erase(self, i: int) -> int:
        with self.model_lock, self.cond:
            cache = self._idle(i)
            n = cache.n
            cache.truncate(0)
            return n
