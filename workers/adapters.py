"""The LoRA adapters an inference worker serves with: each loaded once from the registry (again
when its file changes; a few kept), and a request's scale as a view of the same tensors, made
once per scale — the same object for the same (adapter, scale), so a cached prefix made with it
is reused and one made at another scale is not (the KV cache compares adapters by identity)."""

from __future__ import annotations

from typing import Callable

from kiln.native.lora import load_adapter

KEEP_LOADED = 4            # adapters kept loaded (each tens of MB)
KEEP_SCALED = 16           # scaled views kept (they share their adapter's tensors)


class LoadedAdapters:
    def __init__(self, registry, model: Callable[[], object]):
        self.registry, self.model = registry, model
        self._loaded: dict[str, tuple[float, object]] = {}       # name -> (mtime, Adapter)
        self._scaled: dict[tuple[int, float], tuple[object, object]] = {}

    def get(self, name: str | None, scale=None):
        """The adapter `name` at `scale` (None or 1: as trained), or None for no name.
        AdapterNotFound for an unknown one; AdapterError/GGUFError for one that does not fit."""
        if not name:
            return None
        ad = self._load(name)
        if scale is None or scale == 1:
            return ad
        key = (id(ad), float(scale))
        view = self._scaled.get(key)
        if view is None or view[0] is not ad:
            if len(self._scaled) >= KEEP_SCALED:
                self._scaled.pop(next(iter(self._scaled)))
            view = self._scaled[key] = (ad, ad.scaled(float(scale)))
        return view[1]

    def _load(self, name: str):
        meta = self.registry.get(name)
        cached = self._loaded.get(name)
        if cached and cached[0] == meta["mtime"]:
            return cached[1]
        ad = load_adapter(meta["path"])
        ad.check_fits(self.model().gguf)
        ad.check_applied(self.model())
        self._loaded = {k: v for k, v in self._loaded.items() if k != name}
        if len(self._loaded) >= KEEP_LOADED:
            self._loaded.pop(next(iter(self._loaded)))
        self._loaded[name] = (meta["mtime"], ad)
        return ad
