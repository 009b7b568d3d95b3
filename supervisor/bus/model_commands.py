"""Bus commands for models at run time: ps, load, unload, activate, library (supervisor/placer.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kiln.protocol.vocab import http_status

from ..core.registry import CommandError, command
from ..core.placer import PlaceError


def _placer(sup):
    if sup.placer is None:
        raise CommandError("bad_request", "models are fixed at `kiln up` here ([models] on_demand = false)")
    return sup.placer


def _error(e: PlaceError) -> CommandError:
    return CommandError(e.code, e.message, status=http_status(e.code))


@command("ps")
def ps(sup, args):
    """Loaded models: worker, state, RSS, planned memory, KV cache use, keep_alive, expires-at."""
    p = sup.placer
    models = p.describe() if p else [
        {"model": w.status.get("model") or w.spec.get("model"), "worker": w.name, "state": w.ps.state,
         "pinned": True, "pid": w.pid, "rss_bytes": w.rss} for w in sup.workers.values()
        if w.kind in ("inference", "moe-stream")]
    return {"models": models, "active_model": p.active if p else None,
            "budget_bytes": p.budget if p else None, "used_bytes": p.used_bytes() if p else None}


@command("load")
def load(sup, args):
    """Load a library model now (`model`), as a request naming it would."""
    try:
        w = _placer(sup).place(str(args.get("model") or ""))
    except PlaceError as e:
        raise _error(e) from None
    return {"worker": w.name, "state": w.ps.state}


@command("unload")
def unload(sup, args):
    """Unload a model (by model name or worker) once it is idle; configured workers are pinned."""
    p = _placer(sup)
    model = str(args.get("model") or "")
    w = p.find(model)
    if w is None:
        raise CommandError("model_not_found", f"model {model!r} is not loaded (`kiln ps` lists what is)", status=404)
    if sup.router.busy(w.name) and not args.get("force"):
        raise CommandError("adapter_in_use", f"{w.name} is serving {sup.router.busy(w.name)} request(s); it unloads "
                           f"when they end if you set keep_alive 0, or retry", status=409)
    try:
        return p.unload(w.name, "unloaded on request")
    except PlaceError as e:
        raise _error(e) from None


@command("activate")
def activate(sup, args):
    """Make `model` the default for requests that name none (kept across restarts)."""
    try:
        return _placer(sup).activate(str(args.get("model") or ""))
    except PlaceError as e:
        raise _error(e) from None


@command("library", off_loop=True)
def library(sup, args):
    """The models in the library folders (what a request may name)."""
    from kiln.native.models.library import library_files
    out = []
    for path in library_files():
        try:
            st = path.stat()
        except OSError:
            continue
        out.append({"name": path.stem, "path": str(path), "size_bytes": st.st_size, "modified": st.st_mtime})
    from kiln.native.models.created import listed
    for c in listed():                    # made from a Modelfile: a manifest over a base file
        try:
            st = Path(c["path"]).stat()
        except OSError:
            continue
        out.append({"name": c["name"], "path": c["path"], "size_bytes": st.st_size, "modified": c["created_at"],
                    "from": c["from"], "digest": hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()})
    return {"models": out}


@command("plan", off_loop=True)
def plan_cmd(sup, args):
    """Will `model` load here? Its plan (weights, KV cache at the on-demand context, runtime)
    against what the model budget has left: fits / streams / too_large, with the numbers."""
    from kiln.native.gguf_file import GGUFError
    from kiln.native.models.plan import plan
    p = _placer(sup)
    try:
        path = p._resolve(str(args.get("model") or ""))
        loaded = p.find(path.stem)
        left = p.budget - p.used_bytes() + (p.loaded[loaded.name].planned_bytes if loaded else 0)
        out = plan(path, p.ctx, available=max(0, left), budget=p.budget, kv=p.kv)   # what a load would give it
    except PlaceError as e:
        raise _error(e) from None
    except (GGUFError, ValueError) as e:
        raise CommandError("model_invalid", f"{args.get('model')}: {e}") from None
    return {**out, "budget_bytes": p.budget, "budget_left_bytes": max(0, left), "loaded": loaded is not None}
