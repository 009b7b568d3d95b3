"""Models at run time: which models are loaded, which load next, which unload — inside a RAM budget.

A request that names a library model no worker serves asks the placer for one (`place`). The
placer resolves the name (file stem, `models list` name, path, or an Ollama `name:tag`), reads
the model's plan (weights + KV cache at its context + runtime), and — when the budget or
`max_loaded` would be exceeded — unloads the least recently used *idle* on-demand model first. A
model that cannot fit even then is refused with the numbers (503), never loaded into an OOM. A
worker that is serving a request is never unloaded for another model.

Loaded models expire `keep_alive` after their last request (a request may set its own: 0 unloads
right after the answer, -1 keeps it). Under memory pressure (available RAM below the margin) idle
on-demand models are unloaded, LRU first. Configured `[workers.*]` are pinned: never unloaded.

Runs on the daemon's loop thread (called by the router and the loop's tick): no locks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.protocol.vocab import ALIVE, FATAL, STOPPED

from . import policy
from .config import kv_types
from .cluster_place import no_room, split_specs, stages_needed
from .process_table import ProcessTable, WorkerProcess

MODEL_KINDS = ("inference", "moe-stream")
GiB = 2**30


class PlaceError(Exception):
    def __init__(self, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after = code, message, retry_after


@dataclass
class Loaded:
    """What the placer knows of a model worker it manages (or one configured: pinned)."""
    worker: str
    model: str                      # the file's stem: how clients name it
    path: str
    planned_bytes: int
    pinned: bool
    keep_alive: float | None        # seconds after the last request; None: forever
    last_used: float                # monotonic
    expires_at: float | None = None  # monotonic; None: never
    unloading: str | None = None    # why, once it is being stopped
    file: str | None = None         # the resolved file: a configured `model = "default"` is it too
    context_why: str | None = None  # why its context is what it is (plan's context_why), for `kiln ps`
    stages: tuple = ()              # a model split over a cluster's nodes: its later stage workers


class Placer:
    def __init__(self, table: ProcessTable, *, budget: int, max_loaded: int, keep_alive: float | None,
                 pressure_bytes: int, busy: Callable[[str], int], record: Callable[..., None],
                 resolve: Callable[[str], Path], plan: Callable[..., dict],
                 available: Callable[[], int], ctx: int | None = None, state_file: Path | None = None,
                 weights: str = "mapped", kv: tuple[str, str] = ("f16", "f16")):
        self.table, self.budget, self.max_loaded, self.keep_alive = table, budget, max_loaded, keep_alive
        self.pressure_bytes, self.busy, self.record = pressure_bytes, busy, record
        self.resolve_path, self.plan, self.available, self.ctx = resolve, plan, available, ctx
        self.state_file, self.weights = state_file, weights
        self.nodes_free: Callable[[], list[int]] | None = None   # on a cluster: free bytes of each node alive
        self.kv = tuple(kv)            # an on-demand model's KV cache types ([models] kv_type)
        self.loaded: dict[str, Loaded] = {}
        now = table.clock.monotonic()
        for w in table:
            if w.kind in MODEL_KINDS:
                self.loaded[w.name] = Loaded(w.name, Path(str(w.spec.get("model"))).stem, str(w.spec.get("model")),
                                             0, True, None, now, file=self._file(str(w.spec.get("model"))),
                                             stages=tuple((w.spec.get("settings") or {}).get("stages") or ()))
        self.active = self._read_active()

    # -- the default model ---------------------------------------------------------------------

    def _read_active(self) -> str | None:
        if self.state_file and self.state_file.is_file():
            try:
                return json.loads(self.state_file.read_text()).get("active_model")
            except (ValueError, OSError):
                return None
        return None

    def activate(self, model: str) -> dict:
        path = self._resolve(model)
        self.active = path.stem
        if self.state_file:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            self.state_file.write_text(json.dumps({"active_model": self.active}))
        self.record("model_activated", None, f"{self.active} is the default model")
        return {"active_model": self.active, "path": str(path)}

    # -- finding and placing -------------------------------------------------------------------

    def find(self, model: str) -> WorkerProcess | None:
        """A worker, not being unloaded, that serves `model` (worker name, stem, spec or path)."""
        want = _stem(model)
        for name, l in self.loaded.items():
            if l.unloading or name not in self.table:
                continue
            w = self.table[name]
            if model in (name, l.path, l.model, l.file) or want in (l.model.lower(), name.lower()) or \
                    model == w.status.get("model"):
                return w
        return None

    def _file(self, model: str) -> str | None:
        """A configured worker's file, resolved once: while it boots its status names no model,
        and a request naming the file by stem or path must still find it, not start a twin."""
        try:
            return str(self.resolve_path(model))
        except Exception:  # noqa: BLE001 - a bad path: the worker's own boot reports it
            return None

    def prepare(self, model: str) -> None:
        """Resolve and plan `model` now, on the calling thread (an HTTP thread, the off-loop pool),
        so that `place` on the loop finds its plan — or the file's error — in the plan cache:
        parsing a model file never holds the loop. Errors are left for `place` to report."""
        try:
            if self.find(model) is not None:
                return
            self.plan(self._resolve(model), self.ctx, budget=self.budget, kv=self.kv)
        except Exception:  # noqa: BLE001 - PlaceError, a bad file, the loop changing `loaded` meanwhile
            pass

    def _resolve(self, model: str) -> Path:
        from kiln.native.models.library import ModelNotFound
        try:
            return self.resolve_path(model)
        except (ModelNotFound, ValueError) as e:
            if _stem(model) != model.lower():
                try:
                    return self.resolve_path(_stem(model))       # an Ollama name:tag
                except (ModelNotFound, ValueError):
                    pass
            raise PlaceError("model_not_found", str(e)) from None

    def used_bytes(self) -> int:
        """What the loaded models take: the larger of plan and measured RSS for each. A model
        being unloaded counts as gone: its worker is idle and exits within graceful_timeout; so
        does a configured one stopped by request or given up on (fatal). A configured worker
        that is restarting counts its plan: it will hold that again in a moment."""
        total = 0
        for name, l in self.loaded.items():
            if l.unloading:
                continue
            w = self.table[name] if name in self.table else None
            if w is None or (l.pinned and not w.pid and w.ps.state in (STOPPED, FATAL)):
                continue
            rss = (w.rss or 0) if w.pid else 0
            if w.pid or l.planned_bytes:
                total += max(l.planned_bytes, rss) + l.planned_bytes * len(l.stages)   # a split model's stages too
        return total

    def plan_pinned(self) -> None:
        """The planned memory of the configured model workers — their model's plan at their own
        ctx and parallel, with their draft model; a moe-stream worker's without the experts, with
        its cache (sized by then: supervisor/segments.py) — so that `kiln ps` shows it and a
        worker still loading or restarting counts against the budget before its RSS does. A model
        that cannot be planned counts by its RSS alone: its worker's boot says what is wrong."""
        for l in self.loaded.values():
            if not l.pinned or l.planned_bytes or l.worker not in self.table:
                continue
            w = self.table[l.worker]
            settings = w.spec.get("settings") or {}
            try:
                draft = self.resolve_path(settings["draft_model"]) if settings.get("draft_model") else None
                proj = settings.get("mmproj")
                proj = self.resolve_path(proj) if proj and proj != "off" else proj
                p = self.plan(self.resolve_path(l.path), settings.get("ctx"), parallel=settings.get("parallel"),
                              draft=draft, kv=worker_kv(settings), **({"mmproj": proj} if proj else {}))
            except Exception:  # noqa: BLE001 - a bad path or a corrupt file: the boot reports it
                continue
            need = int(p["total_bytes"])
            if isinstance(settings.get("stage"), list) and len(settings["stage"]) == 2:
                need //= max(1, int(settings["stage"][1]))      # a pipeline's first stage: its share
            if w.kind == "moe-stream":
                if not settings.get("cache_bytes"):
                    continue
                need = streamed_need(p, int(settings["cache_bytes"]))
            l.planned_bytes = need

    def place(self, model: str, keep_alive: float | None | str = "default") -> WorkerProcess:
        """The worker for `model`, starting one (and unloading idle ones) when needed."""
        w = self.find(model)
        if w is not None:
            return w
        path = self._resolve(model)
        w = self.find(path.stem) or self.find(str(path))
        if w is not None:
            return w
        try:
            p = self.plan(path, self.ctx, budget=self.budget, kv=self.kv)   # its context sized by the budget
        except Exception as e:  # noqa: BLE001 - a corrupt file: the reader's own words
            raise PlaceError("model_invalid", f"{path.name}: {e}") from None
        need = int(p["total_bytes"])
        kind, settings = "inference", {"ctx": p["context"]}
        if self.weights != "mapped":
            settings["weights"] = self.weights                       # [models] weights
        if self.kv != ("f16", "f16"):
            settings["kv_type_k"], settings["kv_type_v"] = self.kv    # [models] kv_type
        if p.get("verdict") == "streams":
            # the experts do not fit but the rest does: a moe-stream worker reads them from disk
            # into an expert cache of the planned size
            kind = "moe-stream"
            settings["expert_cache"] = f"{int(p['expert_cache_bytes']) // 2**20}MiB"
            need = streamed_need(p, int(p["expert_cache_bytes"]))
        stages = 1
        if self.nodes_free is not None and kind == "inference":      # a cluster: a node, or several together
            free = self.nodes_free()
            stages = stages_needed(need, free)
            if not stages:
                raise PlaceError("insufficient_memory", no_room(path.stem, need, free), retry_after=5)
        if need > self.budget:
            raise PlaceError("insufficient_memory", (
                f"{path.stem} needs {need / GiB:.2f} GiB (weights {p['weights_bytes'] / GiB:.2f} + KV cache "
                f"{p['kv_cache_bytes'] / GiB:.2f} for {p.get('parallel', 1)} sequences of {p['context']} tokens + "
                f"runtime {p['runtime_bytes'] / GiB:.2f}) "
                f"but the model memory budget is {self.budget / GiB:.2f} GiB ([models] memory_budget)"))
        self._make_room(need, path.stem)
        name = self._name_for(path.stem)
        spec = {"kind": kind, "enabled": True, "model": str(path), "module": "", "threads": 0,
                "settings": settings}
        group = split_specs(name, spec, stages) if stages > 1 else {name: spec}
        for n, s in group.items():
            self.table.add(n, s)
        w = self.table[name]
        ka = self.keep_alive if keep_alive == "default" else keep_alive
        self.loaded[name] = Loaded(name, path.stem, str(path), need // stages, False, ka, self.table.clock.monotonic(),
                                   file=str(path), context_why=p.get("context_why"), stages=tuple(group)[1:])
        self.record("model_loading", name, f"{path.stem}{' (experts streamed)' if kind == 'moe-stream' else ''}: "
                                           f"planned {need / GiB:.2f} GiB"
                                           + (f" in {stages} stages on as many nodes" if stages > 1 else "") + "; "
                                           f"{self.used_bytes() / GiB:.2f} of {self.budget / GiB:.2f} GiB in use")
        for n in group:
            self.table.apply(self.table[n], policy.Start(manual=False))
        return w

    def _name_for(self, stem: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_-]", "-", stem)[:48] or "model"
        name, i = base, 2
        while name in self.table:
            name, i = f"{base}-{i}", i + 1
        return name

    def _make_room(self, need: int, for_model: str) -> None:
        """Unload idle on-demand models, least recently used first, until `need` fits in the
        budget and under max_loaded; refuse if the busy and pinned ones leave too little."""
        def live():
            return [l for l in self.loaded.values() if not l.unloading]

        def fits():
            count_ok = self.max_loaded <= 0 or len(live()) + 1 <= self.max_loaded
            return count_ok and self.used_bytes() + need <= self.budget
        while not fits():
            idle = sorted((l for l in live() if not l.pinned and not self.busy(l.worker)), key=lambda l: l.last_used)
            if not idle:
                why = (f"{len(live())} models are loaded ([models] max_loaded = {self.max_loaded})"
                       if self.max_loaded > 0 and len(live()) + 1 > self.max_loaded else
                       f"{self.used_bytes() / GiB:.2f} GiB of the {self.budget / GiB:.2f} GiB budget is in use "
                       f"and {for_model} needs {need / GiB:.2f} GiB")
                raise PlaceError("insufficient_memory", f"cannot load {for_model}: {why}, and every loaded "
                                 f"model is pinned or serving a request; retry when one is idle", retry_after=5)
            self.unload(idle[0].worker, f"making room for {for_model}")

    def waiting_to_start(self, w: WorkerProcess) -> bool:
        """Placed and not yet spawned (the router must wait, not fail)."""
        l = self.loaded.get(w.name)
        return l is not None and not l.unloading and w.ps.state == STOPPED and w.proc is None \
            and w.ps.last_exit is None

    # -- use, expiry, unloading ----------------------------------------------------------------

    def touch(self, worker: str, keep_alive: float | None | str = "default") -> None:
        """A request on `worker` ended: its model's keep_alive timer restarts."""
        l = self.loaded.get(worker)
        if l is None:
            return
        now = self.table.clock.monotonic()
        l.last_used = now
        if keep_alive != "default":
            l.keep_alive = keep_alive
        if l.pinned:
            return
        l.expires_at = None if l.keep_alive is None else now + l.keep_alive

    def unload(self, worker: str, why: str) -> dict:
        l = self.loaded.get(worker)
        if l is None:
            raise PlaceError("unknown_worker", f"no loaded model on worker {worker!r}")
        if l.pinned:
            raise PlaceError("pinned", f"worker {worker} is configured in kiln.toml ([workers.{worker}]): it stays "
                             f"loaded; `kiln stop {worker}` stops it")
        if l.unloading:
            return {"worker": worker, "unloading": l.unloading}
        l.unloading = why
        self.record("model_unloading", worker, f"{l.model}: {why}")
        for n in (worker, *l.stages):
            w = self.table[n]
            if w.ps.state in ALIVE or w.ps.state != STOPPED:
                self.table.apply(w, policy.Stop())
        return {"worker": worker, "model": l.model, "unloading": why}

    def tick(self) -> None:
        now = self.table.clock.monotonic()
        for name, l in list(self.loaded.items()):
            if name not in self.table:
                del self.loaded[name]
                continue
            if l.unloading:
                group = [self.table[n] for n in (name, *l.stages) if n in self.table]
                if all(x.ps.state == STOPPED and x.proc is None for x in group):
                    for x in group:
                        self.table.remove(x.name)
                    del self.loaded[name]
                    self.record("model_unloaded", name, f"{l.model}: {l.unloading}")
                continue
            if not l.pinned and l.expires_at is not None and now >= l.expires_at and not self.busy(name):
                self.unload(name, "keep_alive expired" if l.keep_alive else "keep_alive 0: unloaded after the answer")
        if self.pressure_bytes > 0:
            avail = self.available()
            if avail < self.pressure_bytes:
                idle = sorted((l for l in self.loaded.values() if not l.pinned and not l.unloading
                               and not self.busy(l.worker)), key=lambda l: l.last_used)
                if idle:
                    self.unload(idle[0].worker, f"memory pressure: {avail / GiB:.2f} GiB available, below "
                                                f"{self.pressure_bytes / GiB:.2f} GiB")

    def describe(self) -> list[dict]:
        now_m, now_w = self.table.clock.monotonic(), self.table.clock.time()
        out = []
        for name, l in self.loaded.items():
            if name not in self.table:
                continue
            w = self.table[name]
            st = w.status or {}
            out.append({"model": l.model, "worker": name, "path": l.path, "state": w.ps.state,
                        "worker_state": w.worker_state, "pinned": l.pinned, "pid": w.pid,
                        "rss_bytes": w.rss if w.pid else None, "planned_bytes": l.planned_bytes or None,
                        "kv_cache_bytes": st.get("kv_cache_bytes"), "kv_cache_tokens": st.get("kv_cache_tokens"),
                        "n_ctx": st.get("n_ctx"), "kv_types": st.get("kv_types"), "context_why": l.context_why or ("configured" if l.pinned else None),
                        "busy": self.busy(name), "node": w.node,
                        "weights": (st.get("weights") or {}).get("mode"),
                        "threads": st.get("threads"), "other_processes_cores": st.get("other_processes_cores"),
                        "keep_alive_s": l.keep_alive, "unloading": l.unloading,
                        "expires_at": None if l.expires_at is None else round(now_w + (l.expires_at - now_m), 3)})
        return out


def worker_kv(settings: dict) -> tuple[str, str]:
    """A model worker's KV cache types from its settings (config.load_config has given a worker
    without its own the [models] ones, so the rest default to f16)."""
    return kv_types({"kv_type": "f16", "kv_type_k": "", "kv_type_v": ""}, settings)


def streamed_need(p: dict, cache_bytes: int) -> int:
    """What a moe-stream worker holds: its model's plan without the experts, with its cache."""
    return int(p["total_bytes"]) - int(p["expert_bytes"]) + cache_bytes


def _stem(model: str) -> str:
    """`name:tag` (Ollama) and `x.gguf` forms, lowered: how a client may name a file."""
    s = model.lower().removesuffix(".gguf")
    if ":" in s and "/" not in s:
        name, tag = s.split(":", 1)
        s = name if tag in ("latest", "") else f"{name}-{tag}"
    return s
