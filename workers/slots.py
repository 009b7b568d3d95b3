"""llama-server's slots, on an inference worker: its sequences (`parallel` of them) listed, and a
slot's KV cache saved to a file, restored from one, or erased — `POST /slots/{id}?action=save|
restore|erase` as llama-server's clients call them. Files live in the worker's `slot_save_path`
(llama-server's --slot-save-path; without it the actions are refused, as llama-server refuses
them) under plain names; a file restores only into a worker of the same model file and cache
types, checked byte for byte (native/kv_file.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from kiln.native import kv_file
from kiln.native.prefix_cache import layout_of
from kiln.native.scheduler_slots import SlotError

from .worker import OpError, op

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ACTIONS = ("list", "save", "restore", "erase")


class SlotOps:
    """The `slots` op of an inference worker (mixed into InferenceWorker)."""

    def _slot_dir(self) -> Path:
        folder = self.settings.get("slot_save_path")
        if not folder:
            raise OpError("bad_request", "slot save and restore are off on this worker: give it a folder "
                                         "(settings.slot_save_path, llama-server's --slot-save-path)")
        path = Path(folder).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _slot_file(self, body: dict) -> Path:
        name = body.get("filename")
        if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
            raise OpError("bad_request", f"filename {name!r} must be a plain file name (letters, digits, . _ -; "
                                         f"no folders), as llama-server requires")
        return self._slot_dir() / name

    def _slot_layout(self) -> dict:
        """What a saved slot's rows are: the prefix cache's layout (the same model file, types and
        shapes), or worked out once when this worker keeps no prefix cache."""
        prefix = self.scheduler.prefix
        if prefix is not None and prefix.layout.get("model_id"):
            return prefix.layout
        if getattr(self, "_layout", None) is None:
            from .prefix_setup import model_identity
            self._layout = layout_of(self.scheduler.seqs[0].cache, model_identity(Path(self.model.path)),
                                     Path(self.model.path).name)
        return self._layout

    @op("slots")
    def slots(self, req):
        action, body = req.body.get("action"), req.body
        if action not in ACTIONS:
            raise OpError("bad_request", f"action must be one of {', '.join(ACTIONS)}")
        sched = self.scheduler
        if sched is None:                      # an encoder: nothing generates, nothing to save
            if action == "list":
                return {"slots": [], "n_ctx": self.n_ctx}
            raise OpError("bad_request", f"{self.model.path.stem} is an encoder: it has no slots to {action}")
        if action == "list":
            return {"slots": sched.slots_info(), "n_ctx": self.n_ctx}
        i = body.get("id")
        if not isinstance(i, int) or not 0 <= i < len(sched.seqs):
            raise OpError("bad_request", f"slot id {i!r} is not one of this worker's 0..{len(sched.seqs) - 1}")
        t0 = time.perf_counter()
        try:
            if action == "erase":
                return {"id_slot": i, "n_erased": sched.slot_erase(i)}
            path = self._slot_file(body)
            layout = self._slot_layout()
            if action == "save":
                tokens, payload = sched.slot_rows(i)
                n = kv_file.write(path, {"layout": layout, "tokens": tokens}, payload)
                return {"id_slot": i, "filename": path.name, "n_saved": len(tokens), "n_written": n,
                        "timings": {"save_ms": round((time.perf_counter() - t0) * 1000, 3)}}
            cache = sched.seqs[i].cache
            if not path.is_file():
                raise OpError("not_found", f"no saved slot {path.name!r} in {path.parent}")
            try:
                head, payload = kv_file.read(path, {"layout": layout}, cache.row_bytes() * self.n_ctx)
            except kv_file.KVFileError as e:
                raise OpError("bad_request", f"{path.name} {e}; it was not restored") from None
            tokens = head.get("tokens")
            if not isinstance(tokens, list) or payload.nbytes != len(tokens) * cache.row_bytes() or \
                    len(tokens) > self.n_ctx or not all(isinstance(t, int) and 0 <= t < self.model.config.n_vocab
                                                        for t in tokens):
                raise OpError("bad_request", f"{path.name} does not hold whole positions of this model; it was not restored")
            sched.slot_restore(i, tokens, payload)
            return {"id_slot": i, "filename": path.name, "n_restored": len(tokens), "n_read": payload.nbytes,
                    "timings": {"restore_ms": round((time.perf_counter() - t0) * 1000, 3)}}
        except SlotError as e:
            raise OpError("bad_request", str(e)) from None
        except OSError as e:
            raise OpError("op_failed", f"slot {action} failed: {e}") from None
