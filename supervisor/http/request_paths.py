"""What an HTTP request may touch on disk: model files in the library folders, data files in
`KILN_HOME/data` — nothing else. The CLI runs as the user and may name any file; a request may
come from anyone who reaches the port, so every path it names is resolved (`realpath`, which
collapses `..` and follows links) and must land inside those folders. The answer for a path
outside is the same whether the file exists or not: a request cannot probe the disk.

A library *entry* may itself be a link the user put there (`~/.kiln/models/m.gguf → /data/m.gguf`):
the folder holding the entry is what is checked, so the entry is served — and deleting it
removes the link, never its target.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .common import JSONError

MAX_DATA_BYTES = 256 * 2**20     # a training or eval file over HTTP (the trainer reads it whole)


def library_folders() -> list[Path]:
    """Kiln's model folders and the other stores the library lists (the hub cache, Ollama's)."""
    from kiln.native.models.discovery import _hf_cache_dirs, _ollama_dir
    from kiln.native.models.library import model_dirs
    return [*model_dirs(), *_hf_cache_dirs(), _ollama_dir()]


def _inside(path: str, folders: list[Path]) -> bool:
    """`path`'s folder, resolved, is one of `folders` (resolved) or below one; its name is a name."""
    name = os.path.basename(path)
    if name in ("", ".", ".."):
        return False
    parent = os.path.realpath(os.path.dirname(os.path.abspath(os.path.expanduser(path))))
    for f in folders:
        root = os.path.realpath(f)
        if parent == root or parent.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def library_entry(path: Path) -> Path:
    """`path` if it is an entry of one of Kiln's own model folders (the only files Kiln deletes or
    links beside), else a 400 that says so."""
    from kiln.native.models.library import model_dirs
    if not _inside(str(path), model_dirs()):
        raise JSONError(400, "not_in_library", f"{path.name} is not in a Kiln model folder "
                        f"({', '.join(map(str, model_dirs()))}); Kiln changes only the files there")
    return Path(os.path.realpath(os.path.dirname(os.path.abspath(path)))) / path.name


def is_path_like(name: str) -> bool:
    """A model reference that names a file rather than a library name: it has a folder in it, starts
    at home, or is a file in the daemon's working folder (the library's resolver takes those first).
    A Hugging Face reference (hf:…, hf.co/ORG/REPO:QUANT, ORG/REPO:QUANT) is a name: it resolves
    in the hub cache only."""
    if os.path.lexists(name):
        return True
    if name.startswith(("hf:", "ollama:", "pkg:")) and ".." not in name.split("/"):
        return False
    from kiln.native.models.hub_refs import parse_ref
    if parse_ref(name, bare=":" in name) is not None and ".." not in name.split("/"):
        return False
    return os.sep in name or "/" in name or name.startswith("~")


def check_model_ref(sup, name, field: str = "model"):
    """A model named in a request: library names pass as they are; a path passes when it lies in a
    library folder, is a configured worker's model, or `models.allow_paths` is on."""
    if not isinstance(name, str) or not name:
        return name
    if len(name) > 1024 or any(ord(c) < 32 for c in name):
        raise JSONError(400, "invalid_value", f"{field} is not a model name (over 1,024 characters, or control "
                        f"characters): name a model from GET /v1/models", param=field)
    if sup.cfg["models"]["allow_paths"] or name in sup.cfg.workers:   # a configured worker's name is a name,
        return name                                                     # whatever files the daemon's folder holds
    if not is_path_like(name):
        return name
    configured = {str(spec.get("model")) for spec in sup.cfg.workers.values()}
    if name in configured or _inside(name, library_folders()):
        return name
    raise JSONError(400, "model_path_not_allowed",
                    f"{field} {name[:200]!r} is a path outside the model library: over HTTP a model is named by "
                    f"its library name (GET /v1/models, `kiln models list`). Put the file in a model folder "
                    f"({library_folders()[0]}), or set models.allow_paths = true to let requests load any "
                    f"file this user can read", param=field)


def data_dir(sup) -> Path:
    return sup.paths.home / "data"


def check_data_file(sup, name, field: str = "file") -> str:
    """A training or eval file named in a request: a regular file inside KILN_HOME/data, of at most
    MAX_DATA_BYTES — never /etc/shadow or /dev/zero. Relative names are taken from that folder."""
    if not isinstance(name, str) or not name:
        raise JSONError(400, "invalid_value", f"{field} must be a file name in {data_dir(sup)}", param=field)
    folder = data_dir(sup)
    path = name if os.path.isabs(name) or name.startswith("~") else str(folder / name)
    if not _inside(path, [folder]):
        raise JSONError(400, "data_path_not_allowed",
                        f"{field} {name[:200]!r} is outside {folder}: over HTTP, data comes in the request "
                        f"(the 'data' field) or from a file in that folder (the CLI may name any file)", param=field)
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        raise JSONError(400, "file_not_found", f"{field}: no file {name[:200]!r} in {folder}", param=field) from None
    if not stat.S_ISREG(st.st_mode):
        raise JSONError(400, "not_a_regular_file", f"{field} {name[:200]!r} is not a regular file", param=field)
    if st.st_size > MAX_DATA_BYTES:
        raise JSONError(400, "file_too_large", f"{field} {name[:200]!r} is {st.st_size} bytes; the most a request "
                        f"may use is {MAX_DATA_BYTES} (split it, or train from the CLI)", param=field)
    return real
