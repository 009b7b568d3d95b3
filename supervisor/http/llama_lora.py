"""llama-server's LoRA surface on Kiln's adapters: `GET /lora-adapters` lists the registered
adapters by id (their names' order) with the scale a request gets when it names none — 1 for the
active adapter, 0 for the others; `POST /lora-adapters [{id, scale}]` makes one active (scale 1)
or none; a request's `lora: [{id, scale}]` picks its adapter and scale (Kiln applies one adapter
per request: more than one with a scale other than 0 is refused, naming them)."""

from __future__ import annotations

import math

from .common import JSONError, parse_json
from .openai_validate import MAX_ADAPTER_SCALE, bad


def _registry(sup):
    from kiln.protocol.store.adapter_registry import AdapterRegistry
    return AdapterRegistry(sup.paths.home)


def _entries(value, field: str) -> list[tuple[int, float]]:
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise bad(field, f"{field} is a list of {{id, scale}}", "invalid_type")
    out = []
    for e in value:
        extra = set(e) - {"id", "scale"}
        if extra:
            raise bad(field, f"{field}: unsupported field {sorted(extra)[0]!r} (each entry is {{id, scale}})", "unsupported_field")
        i, s = e.get("id"), e.get("scale", 1.0)
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise bad(field, f"{field}: id must be an adapter's id (GET /lora-adapters)", "invalid_type")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or abs(s) > MAX_ADAPTER_SCALE:
            raise bad(field, f"{field}: scale must be a number from -{MAX_ADAPTER_SCALE:g} to {MAX_ADAPTER_SCALE:g}")
        out.append((i, float(s)))
    return out


def lora_field(sup, body: dict) -> dict:
    """A request's `lora` as Kiln's `adapter` and `adapter_scale` (none given: {})."""
    if body.get("lora") is None:
        return {}
    if body.get("adapter") is not None or body.get("adapter_scale") is not None:
        raise bad("lora", "give lora or adapter/adapter_scale, not both")
    names = _registry(sup).names()
    chosen = []
    for i, s in _entries(body["lora"], "lora"):
        if i >= len(names):
            raise bad("lora", f"lora: no adapter with id {i} ({len(names)} registered; GET /lora-adapters)")
        if s != 0:
            chosen.append((names[i], s))
    if len(chosen) > 1:
        raise bad("lora", f"lora: {', '.join(n for n, _ in chosen)} at once — Kiln applies one adapter per request "
                          f"(the others at scale 0)")
    if not chosen:
        return {"adapter": ""}                   # every adapter at 0: none, not the active one
    name, s = chosen[0]
    return {"adapter": name, **({"adapter_scale": s} if s != 1 else {})}


class LoraAdapters:
    def __init__(self, sup):
        self.sup = sup

    def on_get(self, req, resp):
        reg = _registry(self.sup)
        active = reg.active()
        resp.media = [{"id": i, "path": str(reg.gguf_path(n)), "name": n, "scale": 1.0 if n == active else 0.0}
                      for i, n in enumerate(reg.names())]

    def on_post(self, req, resp):
        reg = _registry(self.sup)
        names = reg.names()
        entries = _entries(parse_json(req.bounded_stream.read(1 << 16), list), "body")
        on = [(i, s) for i, s in entries if s != 0]
        if any(i >= len(names) for i, _ in entries):
            raise JSONError(400, "invalid_value", f"no adapter with one of those ids ({len(names)} registered)")
        if len(on) > 1 or any(s != 1 for _, s in on):
            raise JSONError(400, "invalid_value", "Kiln keeps one active adapter at scale 1 (or none): give one id at "
                            "scale 1 and the others at 0; another scale goes with each request (lora, adapter_scale)")
        reg.set_active(names[on[0][0]] if on else None)
        self.on_get(req, resp)
