"""A Hugging Face model a request names and this machine does not have yet (`hf.co/ORG/REPO:QUANT`,
`ORG/REPO:QUANT`, `hf:…`), pulled before the request is placed — as `ollama run` and
`llama-server -hf` fetch what they are asked for. The request waits while it downloads (each
reference pulled once at a time, however many requests name it); a file that could not run here
(larger than the memory budget allows) is refused before a byte moves, as `kiln models pull` does."""

from __future__ import annotations

import threading
from typing import Callable


class HubFetch:
    def __init__(self, budget: Callable[[], int], record: Callable[..., None]):
        self.budget, self.record = budget, record
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    @staticmethod
    def missing(model: str):
        """The hub reference `model` is, when it is one and is not in the cache; else None."""
        from kiln.native.models.discovery import cached_model
        from kiln.native.models.hub_refs import parse_ref
        if model.startswith(("ollama:", "pkg:")):
            return None
        ref = parse_ref(model, bare=":" in model)
        if ref is None or ".." in model.split("/"):
            return None
        return None if cached_model(ref) else ref

    def ensure(self, model: str) -> str | None:
        """Pull `model` if it is a hub reference not here yet. None when there is nothing to do or
        the pull succeeded; else what failed, for the request's error."""
        if self.missing(model) is None:
            return None
        with self._guard:
            lock = self._locks.setdefault(model, threading.Lock())
        with lock:
            if self.missing(model) is None:          # another request pulled it meanwhile
                return None
            from kiln.native.models.hub import _hub_cache, check_room, pull_hf
            from kiln.native.models.library import PullError
            self.record("pull", None, f"pulling {model} for a request")
            said: list[str] = []
            try:
                path = pull_hf(model, None, room=lambda name, size: check_room(name, size, _hub_cache(), self.budget()),
                               say=said.append)
            except PullError as e:
                self.record("pull", None, f"pull of {model} failed: {e}")
                return f"model {model!r} is not here and could not be pulled: {e}"
            except Exception as e:  # noqa: BLE001 - a network or disk error must answer the request, not hang it
                self.record("pull", None, f"pull of {model} failed: {type(e).__name__}: {e}")
                return f"model {model!r} is not here and could not be pulled: {type(e).__name__}: {e}"
            self.record("pull", None, f"pulled {model}: {path.name}" + (f" ({'; '.join(said)})" if said else ""))
            return None
