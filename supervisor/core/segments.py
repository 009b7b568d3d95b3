"""Shared-memory segments the supervisor owns for its workers (the MoE expert caches).

A segment is a file in /dev/shm named `kiln-<uid>-<home hash>-<worker>`, mode 0600, so it
outlives a worker that crashes. `kiln up` removes every segment of its KILN_HOME left by a
killed daemon (it holds the single-instance lock, so none of them is in use) and `kiln down`
removes the ones it made."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .units import parse_size

SHM_DIR = Path("/dev/shm")
def prefix(home: Path) -> str:
    return f"kiln-{os.getuid()}-{hashlib.sha256(str(home).encode()).hexdigest()[:10]}-"


def remove_stale(home: Path) -> list[str]:
    removed = []
    if SHM_DIR.is_dir():
        for p in SHM_DIR.glob(prefix(home) + "*"):
            try:
                p.unlink()
                removed.append(p.name)
            except OSError:
                pass
    return removed


def segment_path(home: Path, worker: str) -> Path:
    return SHM_DIR / (prefix(home) + worker)


def create(home: Path, worker: str, size: int) -> Path:
    path = segment_path(home, worker)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return path


def size_cache(home: Path, name: str, spec: dict, record) -> tuple[int, int]:
    """(slots, bytes) of a moe-stream worker's expert cache, from its model and `expert_cache`
    (`auto`: the size `kiln models plan M --stream` measured, or 25 % when it never was).
    Raises ModelNotFound, GGUFError, ValueError (not a size; not an MoE model) or OSError."""
    import psutil

    from kiln.native.experts.cache import segment_bytes
    from kiln.native.experts.store import ExpertStore
    from kiln.native.gguf_file import read_gguf
    from kiln.native.models.library import resolve_model
    from kiln.native.models.tune import load_tuned

    path = resolve_model(spec["model"])
    size_text = (spec.get("settings") or {}).get("expert_cache", "25%")
    if str(size_text).strip().lower() == "auto":
        tuned = load_tuned(home, path)
        if tuned is None:
            size_text = "25%"
            record("expert_cache_untuned", name,
                   f"expert_cache = auto but {path.name} was never measured here: using 25% of RAM; "
                   f"`kiln models plan {path} --stream` measures it")
        else:
            size_text = f"{tuned['suggested_bytes']}B"
            record("expert_cache_tuned", name, f"expert_cache = auto: {tuned['suggested_bytes'] / 2**20:.0f} "
                   f"MiB ({tuned['rule']}, measured {tuned['measured_at']})")
    budget = parse_size(size_text, psutil.virtual_memory().total)
    g = read_gguf(path, skip_arrays=True)
    store = ExpertStore(path, parts=g.parts)
    try:
        return segment_bytes(g, store, budget)
    finally:
        store.close()


def make_for_workers(home: Path, table, record) -> list[Path]:
    """Expert caches for the moe-stream workers, sized from their model and budget (settings
    `cache_slots`, `cache_bytes`), and a segment for each whose cache lives in shared memory
    (`shm`); stale segments of a killed daemon are removed first. Where the cache goes is the
    worker's `cache_memory` (native/expert_memory.place): a worker whose cache will be private
    gets no segment — it would never be touched. A worker whose cache cannot be sized or whose
    segment cannot be made gets none and then fails at boot with a clear reason."""
    from kiln.native.experts.memory import place
    from kiln.native.gguf_file import GGUFError
    from kiln.native.models.library import ModelNotFound

    stale = remove_stale(home)
    if stale:
        record("stale_segments_removed", None, ", ".join(stale))
    made = []
    for w in table:
        if w.kind != "moe-stream":
            continue
        try:
            slots, size = size_cache(home, w.name, w.spec, record)
        except (ModelNotFound, GGUFError, ValueError, OSError) as e:
            record("segment_failed", w.name, str(e))
            w.spec = dict(w.spec, settings={**w.spec["settings"], "cache_error": str(e)})   # its boot says it
            continue
        settings = {**w.spec["settings"], "cache_slots": slots, "cache_bytes": size}
        try:
            placement = place(settings.get("cache_memory", "auto"), str(segment_path(home, w.name)))
        except ValueError:                    # not a choice: the worker's boot says so, with the choices
            w.spec = dict(w.spec, settings=settings)
            continue
        if placement.kind == "shared":
            seg = create(home, w.name, size)
            made.append(seg)
            settings["shm"] = str(seg)
            record("segment_created", w.name, f"{seg.name}: {slots} expert slots, {size / 2**20:.1f} MiB")
        else:
            record("segment_skipped", w.name, f"{slots} expert slots, {size / 2**20:.1f} MiB in the worker's "
                                              f"own memory: {placement.why}")
        w.spec = dict(w.spec, settings=settings)
    return made
