"""HF/TRL bundles (issue 42): a folder a GPU machine trains from with Transformers + TRL + PEFT —
the data as canonical JSONL, a small trainer script, and a manifest with the size and sha256 of
every byte — and what it sends back (an `adapter/` folder with its own manifest), checked before
Kiln reads any of it. Bundles live under KILN_HOME/hf/<name>; a bundle from elsewhere may come as
a folder or a .tar/.tar.gz archive, read defensively: regular files only (no links, devices or
folders outside it), no absolute or `..` paths, bounded sizes, every file in the manifest and
every byte matching it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tarfile
from pathlib import Path

FORMAT = "kiln-hf-bundle/1"
MAX_MANIFEST = 1 << 20
MAX_FILE = 8 << 30                 # an adapter or a dataset: far below; a 'file' past it is hostile
MAX_FILES = 64
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class BundleError(ValueError):
    """A bundle that cannot be written, found or trusted; the message names the file and field."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def canonical_jsonl(rows: list[dict]) -> bytes:
    """One JSON object per line, keys sorted, no spaces, UTF-8: the same rows give the same bytes."""
    return b"".join(json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
                    for r in rows)


def write_bundle(folder: Path, files: dict[str, bytes], meta: dict) -> dict:
    """Write `files` and manifest.json (their sizes and sha256, and `meta`) into a new `folder`."""
    if folder.exists():
        raise BundleError(f"{folder} exists: choose another name or delete it first")
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, mode=0o700)
    listed = {}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
        listed[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": FORMAT, **meta, "files": listed}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    tmp.rename(folder)
    return manifest


def read_manifest(folder: Path, name: str = "manifest.json") -> dict:
    p = folder / name
    try:
        st = os.lstat(p)
    except OSError:
        raise BundleError(f"{p}: no manifest (not a bundle, or not finished)") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST:
        raise BundleError(f"{p}: not a regular file of at most {MAX_MANIFEST} bytes")
    try:
        m = json.loads(p.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleError(f"{p}: not JSON: {e}") from None
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict) or len(m["files"]) > MAX_FILES:
        raise BundleError(f"{p}: field 'files' must map at most {MAX_FILES} file names to their bytes and sha256")
    return m


def verify(folder: Path, manifest_name: str = "manifest.json") -> dict:
    """The manifest, once every file it lists is a regular file inside `folder` whose size and
    sha256 match; BundleError naming the first file and field that do not."""
    m = read_manifest(folder, manifest_name)
    for name, want in m["files"].items():
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not NAME.match(name):
            raise BundleError(f"{folder}: manifest lists {str(name)[:80]!r}: a file name of the bundle's own folder")
        if not (isinstance(want, dict) and isinstance(want.get("bytes"), int) and isinstance(want.get("sha256"), str)):
            raise BundleError(f"{folder}: files.{name} needs bytes and sha256")
        p = folder / name
        try:
            st = os.lstat(p)
        except OSError:
            raise BundleError(f"{folder}: files.{name}: missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise BundleError(f"{folder}: files.{name}: not a regular file (a link or device is refused)")
        if st.st_size != want["bytes"]:
            raise BundleError(f"{folder}: files.{name}.bytes: the manifest says {want['bytes']}, the file has {st.st_size}")
        got = sha256_file(p)
        if got != want["sha256"]:
            raise BundleError(f"{folder}: files.{name}.sha256: the manifest says {want['sha256'][:16]}…, "
                              f"the file's is {got[:16]}… (changed since it was written)")
    return m


def unpack(archive: Path, into: Path) -> Path:
    """A .tar/.tar.gz bundle into a new folder, member by member: regular files and folders only,
    relative paths that stay inside, bounded count and sizes. Returns the folder."""
    try:
        tf = tarfile.open(archive)
    except (OSError, tarfile.TarError) as e:
        raise BundleError(f"{archive}: not a readable tar archive: {e}") from None
    with tf:
        members = []
        for i, m in enumerate(tf):
            if i >= 2 * MAX_FILES:
                raise BundleError(f"{archive}: more than {2 * MAX_FILES} members")
            parts = Path(m.name).parts
            if m.name.startswith("/") or ".." in parts or not parts:
                raise BundleError(f"{archive}: member {m.name!r}: an absolute or '..' path is refused")
            if not (m.isfile() or m.isdir()):
                raise BundleError(f"{archive}: member {m.name!r}: links and devices are refused")
            if m.size > MAX_FILE:
                raise BundleError(f"{archive}: member {m.name!r}: {m.size} bytes, over {MAX_FILE}")
            members.append(m)
        into.mkdir(parents=True, mode=0o700)
        for m in members:
            target = into / m.name
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True, mode=0o700)
                continue
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            src = tf.extractfile(m)
            with open(target, "wb") as out:
                left = m.size
                while left > 0:
                    block = src.read(min(1 << 20, left))
                    if not block:
                        raise BundleError(f"{archive}: member {m.name!r} ends early")
                    out.write(block)
                    left -= len(block)
    tops = [p for p in into.iterdir()]
    return tops[0] if len(tops) == 1 and tops[0].is_dir() and not (into / "manifest.json").exists() else into


class Bundles:
    """The bundles under KILN_HOME/hf."""

    def __init__(self, home: Path):
        self.root = Path(home) / "hf"

    def path(self, name: str) -> Path:
        if not NAME.match(name):
            raise BundleError(f"bundle name {name!r}: letters, digits, '.', '_' and '-' (at most 64)")
        return self.root / name

    def list(self) -> list[dict]:
        out = []
        for p in sorted(self.root.glob("*")) if self.root.is_dir() else []:
            if p.is_dir() and not p.name.endswith(".part"):
                try:
                    m = read_manifest(p)
                except BundleError as e:
                    out.append({"name": p.name, "error": str(e)})
                    continue
                out.append({"name": p.name, "kind": m.get("kind"), "hf_model": m.get("hf_model"),
                            "created": m.get("created"), "rows": m.get("rows"),
                            "trained": (p / "adapter" / "manifest.json").is_file()})
        return out

    def delete(self, name: str) -> None:
        p = self.path(name)
        if not p.is_dir():
            raise BundleError(f"no bundle named {name!r} (kiln train hf list)")
        shutil.rmtree(p)
