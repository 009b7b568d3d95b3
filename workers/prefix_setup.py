"""An inference worker's prefix cache (native/prefix_cache.py), from its settings:

- `prefix_cache`: its RAM budget — "auto" (one sequence's KV cache at the whole context, at most
  1 GiB: what the memory plan counts), a size ("512MiB", "5%"), or 0 / "off";
- `prefix_cache_disk`: the budget of its folder under KILN_HOME/cache/prefix — "auto" (4 GiB),
  a size, or 0 / "off".

Blocks on disk are filed under the model file's identity: its pull manifest's sha256 when it has
one, else a fingerprint of its content (model_identity).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import psutil

from kiln.native.models.folders import kiln_home
from kiln.native.models.integrity import manifest_path
from kiln.native.prefix_cache import PrefixCache, auto_ram_bytes, layout_of
from kiln.protocol.units import parse_size

AUTO_DISK = 4 << 30


class PrefixSettingError(ValueError):
    pass


def budget(value, auto: int, what: str) -> int:
    if value in (None, "auto"):
        return auto
    if value in (0, "0", "off", False):
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    try:
        return parse_size(str(value), psutil.virtual_memory().total, what)
    except ValueError as e:
        raise PrefixSettingError(f"{e} (or auto, or off)") from None


def attach(scheduler, model, n_ctx: int, settings: dict) -> None:
    """Give `scheduler` its prefix cache, if the settings and the model allow one."""
    cache = model.new_cache(8)
    if not cache.can_rewind or not cache.whole:
        return                  # sliding-window or recurrent layers: positions are dropped or folded;
                                # a pipeline stage: the next stage holds the other layers' rows
    ram = budget(settings.get("prefix_cache"), auto_ram_bytes(cache.row_bytes() * n_ctx), "prefix_cache")
    disk = budget(settings.get("prefix_cache_disk"), AUTO_DISK, "prefix_cache_disk")
    if not ram and not disk:
        return
    path = Path(model.path)
    scheduler.prefix = PrefixCache(layout_of(cache, model_identity(path), path.name), max(ram, 1),
                                   kiln_home() / "cache" / "prefix", disk)


def model_identity(path: Path) -> str:
    """What names a model file's blocks: its pull manifest's sha256 (checked against the file's
    size), else a fingerprint — the sha256 of its size, its first MiB (header, metadata, tensor
    table) and 64 KiB at each of 32 places through it. A whole-file hash would read a model of
    tens of GB at every boot and fill the page cache with the experts a stream worker keeps out
    of it; the samples are dropped from the page cache again once read."""
    try:
        doc = json.loads(manifest_path(path).read_text())
        if doc.get("size") == path.stat().st_size and isinstance(doc.get("sha256"), str):
            return "sha256-" + doc["sha256"]
    except (OSError, ValueError, TypeError):
        pass
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    fd = os.open(path, os.O_RDONLY)
    try:
        spots = [(0, min(size, 1 << 20))] + [(size * i // 32, 1 << 16) for i in range(1, 32)]
        for off, n in spots:
            h.update(os.pread(fd, n, off))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "fp-" + h.hexdigest()
