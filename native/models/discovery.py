"""Finding GGUF models where users already keep them, and describing each one cheaply.

Sources: the model folders (`$KILN_HOME/models`, `KILN_MODEL_PATH`), the Hugging Face hub cache
(`HF_HUB_CACHE`, `HF_HOME/hub`, `~/.cache/huggingface/hub`: models--org--name/snapshots/<rev>/),
Ollama's store (`OLLAMA_MODELS`, `~/.ollama/models`: manifests → model blobs), and `.gguf`
files inside installed Python packages. Split GGUFs (`-00001-of-0000N.gguf`) are one model.
A file that cannot be read is listed with the reason, never skipped and never fatal.

Headers are read without the vocabulary arrays and cached by (path, size, mtime) in
`$KILN_HOME/cache/headers.json`, so listing many models is fast after the first time.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from gguf import LlamaFileType

from ..gguf_file import GGUFError, read_gguf
from .folders import kiln_home, model_dirs

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass
class ModelEntry:
    name: str
    source: str                  # folder | hf-cache | ollama | package
    path: str
    file_bytes: int
    architecture: str | None = None
    parameters: int | None = None
    quantization: str | None = None
    context_length: int | None = None
    parts: int = 1
    error: str | None = None


def _hf_cache_dirs() -> list[Path]:
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]) / "hub"]
    return [Path.home() / ".cache" / "huggingface" / "hub"]


def _ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def _candidates() -> list[tuple[str, str, Path]]:
    """(name, source, path) of every GGUF file found, before reading any header."""
    found: list[tuple[str, str, Path]] = []
    for d in model_dirs():
        if d.is_dir():
            found += [(p.relative_to(d).as_posix().removesuffix(".gguf"), "folder", p)
                      for p in sorted(d.rglob("*.gguf")) if p.is_file()]
    for hub in _hf_cache_dirs():
        if not hub.is_dir():
            continue
        for repo in sorted(hub.glob("models--*")):
            org_name = repo.name[len("models--"):].replace("--", "/", 1)
            for snap in sorted((repo / "snapshots").glob("*")):
                for p in sorted(snap.rglob("*.gguf")):
                    rel = p.relative_to(snap).as_posix()
                    found.append((f"hf:{org_name}/{rel}@{snap.name[:8]}", "hf-cache", p))
    olla = _ollama_dir()
    manifests = olla / "manifests"
    if manifests.is_dir():
        for mf in sorted(p for p in manifests.rglob("*") if p.is_file()):
            parts = mf.relative_to(manifests).parts         # registry/namespace/name/tag
            name = ":".join(["/".join(parts[-3:-1]).removeprefix("library/"), parts[-1]])
            try:
                layers = json.loads(mf.read_text()).get("layers", [])
                digest = next(l["digest"] for l in layers if l.get("mediaType") == OLLAMA_MODEL_LAYER)
                found.append((f"ollama:{name}", "ollama", olla / "blobs" / digest.replace(":", "-")))
            except (ValueError, StopIteration, KeyError, OSError) as e:
                # "ollama!<reason>": listed with the reason, no header to read
                found.append((f"ollama:{name}", f"ollama!unreadable manifest ({type(e).__name__})", mf))
    try:
        for dist in metadata.distributions():
            for f in dist.files or []:
                if str(f).endswith(".gguf"):
                    p = Path(dist.locate_file(f))
                    if p.is_file():
                        found.append((f"pkg:{dist.metadata['Name']}/{p.name.removesuffix('.gguf')}", "package", p))
    except Exception:  # noqa: BLE001 - a broken distribution must not break listing
        pass
    return found


class HeaderCache:
    def __init__(self, path: Path | None = None):
        self.path = path or kiln_home() / "cache" / "headers.json"
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.dirty = False

    def describe(self, path: Path) -> dict:
        st = path.stat()
        key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
        if key not in self.data:
            self.data[key] = _describe(path)
            self.dirty = True
        return self.data[key]

    def save(self) -> None:
        if self.dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)


def _quantization(g) -> str:
    ft = g.metadata.get("general.file_type")
    if ft is not None:
        try:
            return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    counts: dict[str, int] = {}
    for t in g.tensors.values():
        counts[t.type.name] = counts.get(t.type.name, 0) + t.n_bytes
    return max(counts, key=counts.get) if counts else "?"


def _describe(path: Path) -> dict:
    try:
        g = read_gguf(path, skip_arrays=True)
        arch = g.architecture
        return {"architecture": arch, "parameters": sum(t.n_elements for t in g.tensors.values()),
                "quantization": _quantization(g), "context_length": g.metadata.get(f"{arch}.context_length"),
                "split_count": g.metadata.get("split.count")}
    except GGUFError as e:
        return {"error": str(e).split(": ", 1)[-1]}
    except Exception as e:  # noqa: BLE001 - an odd file is reported, not fatal
        return {"error": f"{type(e).__name__}: {e}"}


def discover() -> list[ModelEntry]:
    cache = HeaderCache()
    entries: list[ModelEntry] = []
    for name, source, path in _candidates():
        if source.startswith("ollama!"):
            entries.append(ModelEntry(name, "ollama", str(path), 0, error=source.split("!", 1)[1]))
            continue
        m = _SPLIT.search(path.name)
        if m:
            if m.group(1) != "00001":
                continue                   # the set is listed once, by its first part
            name = re.sub(r"-\d{5}-of-\d{5}(\.gguf)?", r"\1", name)
        try:
            size = path.stat().st_size
        except OSError as e:
            entries.append(ModelEntry(name, source, str(path), 0, error=f"cannot stat: {e.strerror}"))
            continue
        info = cache.describe(path)
        e = ModelEntry(name, source, str(path), size, info.get("architecture"), info.get("parameters"),
                       info.get("quantization"), info.get("context_length"), error=info.get("error"))
        entries.append(e)
    for e in entries:                      # split models: size and part count of the whole set
        m = _SPLIT.search(Path(e.path).name)
        if m:
            parts = sorted(Path(e.path).parent.glob(_SPLIT.sub("", Path(e.path).name) + "-*-of-" + m.group(2) + ".gguf"))
            e.parts = len(parts)
            e.file_bytes = sum(p.stat().st_size for p in parts)
            if e.parts != int(m.group(2)) and not e.error:
                e.error = f"split model is incomplete: {e.parts} of {int(m.group(2))} parts present"
    from .created import listed
    for c in listed():                     # made from a Modelfile: described by its base file
        base = Path(c["path"])
        if not base.is_file():
            entries.append(ModelEntry(c["name"], "created", str(base), 0, error=f"its base {c['from']!r} is gone"))
            continue
        info = cache.describe(base)
        entries.append(ModelEntry(c["name"], "created", str(base), base.stat().st_size, info.get("architecture"),
                                  info.get("parameters"), info.get("quantization"), info.get("context_length"),
                                  error=info.get("error")))
    cache.save()
    return entries


def as_dicts(entries: list[ModelEntry]) -> list[dict]:
    return [asdict(e) for e in entries]


def cached_model(ref) -> Path | None:
    """The file a hub reference (hub_refs.HubRef) names in the Hugging Face cache, chosen by the
    same rule as a pull (a quant tag's file, the first part of a split model), or None."""
    from .hub_refs import best_model
    for hub in _hf_cache_dirs():
        repo_dir = hub / ("models--" + ref.repo.replace("/", "--"))
        snaps = repo_dir / "snapshots"
        if not snaps.is_dir():
            continue
        pinned = repo_dir / "refs" / ref.rev.replace("/", "_")
        commit = pinned.read_text().strip() if pinned.is_file() else None
        order = sorted(snaps.iterdir(), key=lambda d: (d.name != commit, not d.name.startswith(ref.rev),
                                                        -d.stat().st_mtime))
        for snap in order:
            names = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*.gguf"))
            if ref.file is not None:
                pick = next((n for n in names if n.lower() == ref.file.lower()), None)
            else:
                pick = best_model(names, ref.tag)
            if pick is not None and (snap / pick).is_file():
                return snap / pick
    return None


def find(name: str) -> Path | None:
    """A discovered model by its listed name (hf:…, ollama:…, pkg:…, or a folder name)."""
    for e in discover():
        if e.name == name and not e.error:
            return Path(e.path)
    return None


__all__ = ["ModelEntry", "discover", "find", "as_dicts"]
