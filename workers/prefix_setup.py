"""An inference worker's prefix cache (native/prefix_cache.py), from its settings:

- `prefix_cache`: its RAM budget — "auto" (one sequence's KV cache at the whole context, at most
  1 GiB: what the memory plan counts), a size ("512MiB", "5%"), or 0 / "off";
- `prefix_cache_disk`: the budget of its folder under KILN_HOME/cache/prefix — "auto" (4 GiB),
  a size, or 0 / "off".

Blocks on disk are filed under the model's sha256: from the file's pull manifest when it has one
(checked against its size), else hashed once in the background (remembered by path, size and
mtime) — until then the cache works in RAM only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
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
    if not cache.can_rewind:
        return                  # sliding-window or recurrent layers: positions are dropped or folded
    ram = budget(settings.get("prefix_cache"), auto_ram_bytes(cache.row_bytes() * n_ctx), "prefix_cache")
    disk = budget(settings.get("prefix_cache_disk"), AUTO_DISK, "prefix_cache_disk")
    if not ram and not disk:
        return
    folder = kiln_home() / "cache" / "prefix"
    path = Path(model.path)

    def make(sha: str | None) -> PrefixCache:
        return PrefixCache(layout_of(cache, sha, path.name), max(ram, 1), folder if sha else None, disk)

    sha = manifest_sha256(path)
    scheduler.prefix = make(sha)
    if sha is None and disk:
        def hashed():
            digest = file_sha256(path, folder)
            if digest:
                scheduler.prefix = make(digest)     # from now on blocks go to disk too
        threading.Thread(target=hashed, name="kiln-model-hash", daemon=True).start()


def manifest_sha256(path: Path) -> str | None:
    try:
        doc = json.loads(manifest_path(path).read_text())
        return doc["sha256"] if doc.get("size") == path.stat().st_size else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def file_sha256(path: Path, folder: Path) -> str | None:
    """The file's sha256, remembered in folder/identities.json by path, size and mtime."""
    memo = folder / "identities.json"
    try:
        st = path.stat()
        key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        known = json.loads(memo.read_text()) if memo.exists() else {}
        if not isinstance(known, dict):
            known = {}
        if isinstance(known.get(key), str):
            return known[key]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        known[key] = h.hexdigest()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".identities.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
        return known[key]
    except (OSError, ValueError) as e:
        print(f"kiln prefix cache: cannot identify {path} ({e}); blocks stay in RAM only", file=sys.stderr)
        return None
