"""How a Hugging Face model reference names files, by llama.cpp's rules (common/download.cpp), so
that `kiln models pull hf.co/ORG/REPO:Q4_K_M` fetches what `llama-server -hf ORG/REPO:Q4_K_M` and
`ollama pull hf.co/ORG/REPO:Q4_K_M` fetch.

The forms: `hf:ORG/REPO[/FILE.gguf][@REV]`, `hf:ORG/REPO:QUANT[@REV]`, `hf.co/ORG/REPO[:QUANT]`
(Ollama's; `huggingface.co/` and an `https://` in front are the same) and `ORG/REPO[:QUANT]`
(llama-server's). The quant tag is case-insensitive; without one, Q4_K_M, then Q8_0, then the
repo's first model file. A split model (`-00001-of-00003.gguf`) is all its parts; a vision
model's projector (`mmproj-*.gguf`) is the one beside it whose quantization is nearest.
Ollama's own registry names (`llama3.2:1b`, `library/…`, `registry.ollama.ai/…`) are refused:
there is no Ollama registry here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")              # what no tag means, in order (llama.cpp's)
SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")   # GGUFs that are not a model

_NAME = r"[A-Za-z0-9][\w.-]{0,95}"
_REPO = rf"(?P<repo>{_NAME}/{_NAME})"
_TAG = r"(?::(?P<tag>[A-Za-z0-9_.-]{1,64}))?"
_REV = r"(?:@(?P<rev>[\w./-]{1,128}))?"
_FORMS = [
    re.compile(rf"^hf:{_REPO}(?:/(?P<file>[^@:]+\.gguf))?{_REV}$"),
    re.compile(rf"^hf:{_REPO}{_TAG}{_REV}$"),
    re.compile(rf"^(?:https?://)?(?:hf\.co|huggingface\.co)/{_REPO}{_TAG}$", re.I),
    re.compile(rf"^{_REPO}{_TAG}$"),
]
_REGISTRY = re.compile(r"^(?:(?:https?://)?(?:registry\.ollama\.ai|ollama\.com)/|library/)", re.I)
_OLLAMA = re.compile(_REGISTRY.pattern + r"|^[\w.-]+(?::[\w.-]+)?$", re.I)
_SPLIT = re.compile(r"^(.+)-(\d{5})-of-(\d{5})$", re.I)
_QUANT = re.compile(r"[-.]([A-Z0-9_]+)$", re.I)


@dataclass(frozen=True)
class HubRef:
    repo: str                       # ORG/REPO
    tag: str | None = None          # a quant tag (Q4_K_M), matched case-insensitively
    file: str | None = None         # a file named outright (hf:ORG/REPO/FILE.gguf)
    rev: str = "main"

    def __str__(self) -> str:
        what = f"/{self.file}" if self.file else f":{self.tag}" if self.tag else ""
        return f"hf:{self.repo}{what}" + (f"@{self.rev}" if self.rev != "main" else "")


def parse_ref(spec: str, bare: bool = True) -> HubRef | None:
    """The hub reference `spec` is, or None when it is none of the forms. `bare`: whether
    `ORG/REPO[:QUANT]` counts (where a hub name is expected: `kiln models pull`, `/api/pull`;
    elsewhere it may be a relative path)."""
    spec = spec.strip()
    if _REGISTRY.match(spec):
        return None
    for i, form in enumerate(_FORMS):
        if i == 3 and not bare:
            break
        m = form.match(spec)
        if m:
            d = m.groupdict()
            return HubRef(d["repo"], d.get("tag"), d.get("file"), d.get("rev") or "main")
    return None


def registry_refusal(spec: str) -> str | None:
    """Why `spec`, an Ollama registry name, cannot be pulled here (None when it is not one)."""
    if spec == "default" or not _OLLAMA.match(spec.strip()):
        return None
    return (f"{spec!r} is an Ollama registry name, and there is no Ollama registry here: pull a GGUF from "
            f"Hugging Face instead (hf.co/ORG/REPO:QUANT, e.g. hf.co/bartowski/Qwen3-4B-GGUF:Q4_K_M)")


@dataclass(frozen=True)
class Split:
    prefix: str                     # the name without .gguf and without -0000i-of-0000n
    tag: str                        # its quantization, upper case ("" when it has none)
    index: int
    count: int


def split_of(path: str) -> Split | None:
    """What a file name says: its prefix, quantization tag, and which part of how many."""
    if not path.lower().endswith(".gguf"):
        return None
    prefix, index, count = path[:-5], 1, 1
    m = _SPLIT.match(prefix)
    if m:
        prefix, index, count = m[1], int(m[2]), int(m[3])
    q = _QUANT.search(prefix)
    return Split(prefix, q[1].upper() if q else "", index, count)


def quant_bits(path: str) -> int:
    """The bits a file's quantization tag names (Q4_K_M → 4, F16 → 16; 0 when none)."""
    s = split_of(path)
    m = re.search(r"\d+", s.tag) if s else None
    return int(m[0]) if m else 0


def is_model(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.lower().endswith(".gguf") and not any(k in name for k in SIDECARS)


def _first_part(path: str) -> bool:
    s = split_of(path)
    return s is not None and (s.count <= 1 or s.index == 1)


def best_model(files: list[str], tag: str | None) -> str | None:
    """The file a tag picks: the first model file (in the repo's order) whose name has the tag
    followed by '.' or '-'; without a tag Q4_K_M, then Q8_0, then the first model file."""
    for t in ([tag] if tag else DEFAULT_TAGS):
        pattern = re.compile(re.escape(t) + r"[.-]", re.I)
        for f in files:
            if is_model(f) and _first_part(f) and pattern.search(f):
                return f
    if not tag:
        return next((f for f in files if is_model(f) and _first_part(f)), None)
    return None


def parts_of(files: list[str], primary: str) -> list[str]:
    """Every part of a split model, in order (the file alone when it is not split)."""
    s = split_of(primary)
    if s is None or s.count <= 1:
        return [primary]
    found = {}
    for f in files:
        t = split_of(f)
        if t is not None and t.count == s.count and t.prefix == s.prefix:
            found[t.index] = f
    return [found[i] for i in sorted(found)]


def best_mmproj(files: list[str], model: str) -> str | None:
    """A vision model's projector: an `mmproj` GGUF in the model's folder or above it — the
    deepest such folder, then the quantization nearest the model's."""
    model_dir = PurePosixPath(model).parent.parts
    bits = quant_bits(model)
    best, key = None, None
    for f in files:
        if not f.lower().endswith(".gguf") or "mmproj" not in f:
            continue
        d = PurePosixPath(f).parent.parts
        if d != model_dir[:len(d)]:
            continue
        k = (-len(d), abs(quant_bits(f) - bits))
        if key is None or k < key:
            best, key = f, k
    return best


def tags_in(files: list[str]) -> list[str]:
    """The quantization tags a repo offers (for an error that lists them)."""
    return sorted({s.tag for f in files if is_model(f) and (s := split_of(f)) and s.tag})



def mmprojs_beside(model: Path) -> list[Path]:
    """The projectors in a model's own folder (where a pull puts its own), likeliest first: the
    name sharing most with the model's, then the quantization nearest it (best_mmproj's rule) —
    the caller takes the first that fits the model."""
    try:
        names = [p.name for p in model.parent.iterdir() if p.is_file() and p.suffix.lower() == ".gguf"
                 and "mmproj" in p.name.lower()]
    except OSError:
        return []
    stem, bits = model.stem.lower(), quant_bits(model.name)

    def affinity(name: str) -> tuple:
        rest = re.sub(r"mmproj[-_.]?", "", name.lower()).removesuffix(".gguf")
        shared = next((i for i, (a, b) in enumerate(zip(rest, stem)) if a != b), min(len(rest), len(stem)))
        return -shared, abs(quant_bits(name) - bits), name
    return [model.parent / n for n in sorted(names, key=affinity)]
