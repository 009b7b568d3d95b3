"""`kiln models pull hf:ORG/REPO[/FILE.gguf][@REV]`.

huggingface_hub answers what to fetch (the revision's commit, the file's size and sha256, its
URL); the transfer is ours, because huggingface_hub 2.x names its partial files randomly and
deletes them on Ctrl-C, so a download never resumes across runs. Ours writes into the Hugging
Face cache layout (blobs/<sha256>, snapshots/<commit>/<file> → blob, refs/<rev>), so other
tools share the file and `kiln models list` finds it; a partial `blobs/<sha256>.kiln-partial`
survives Ctrl-C or a crash and the next pull resumes it with an HTTP Range request. The result
is verified against the hub's sha256 before it appears: a mismatch deletes it and says so.
"""

from __future__ import annotations

import os
import shutil
import re
from pathlib import Path

from .library import PullError, sha256_file

_SPEC = re.compile(r"^hf:(?P<repo>[\w.-]+/[\w.-]+)(?:/(?P<file>[^@]+\.gguf))?(?:@(?P<rev>[\w./-]+))?$")


def parse_spec(spec: str) -> tuple[str, str | None, str]:
    m = _SPEC.match(spec)
    if not m:
        raise PullError(f"{spec!r} is not hf:ORG/REPO[/FILE.gguf][@REVISION]")
    return m["repo"], m["file"], m["rev"] or "main"


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _transfer(url: str, part: Path, size: int, progress) -> None:
    """Download url into `part`, resuming from its current length."""
    import urllib.error
    import urllib.request
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if have == size:
        return
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-", "Accept-Encoding": "identity",
                                               "User-Agent": "kiln"})
    try:
        resp = urllib.request.urlopen(req, timeout=60)
    except urllib.error.URLError as e:
        raise PullError(f"download failed: {e}; run the same pull again to resume") from None
    with resp:
        if have and resp.status != 206:          # the server ignored Range: start over
            have = 0
        with open(part, "ab" if have else "wb") as out:
            done = have
            while True:
                try:
                    block = resp.read1(1 << 20)      # what has arrived: a Ctrl-C loses nothing
                except (OSError, ValueError) as e:
                    raise PullError(f"download interrupted at {done:,} of {size:,} bytes ({e}); "
                                    f"run the same pull again to resume") from None
                if not block:
                    break
                out.write(block)
                done += len(block)
                if progress:
                    progress(done, size)
    if part.stat().st_size < size:
        raise PullError(f"download ended at {part.stat().st_size:,} of {size:,} bytes; "
                        f"run the same pull again to resume")


def check_room(name: str, size: int, dest: Path, available_ram: int, force: bool = False) -> None:
    """Refuse a download that cannot be used here, before a byte moves: the disk must hold it,
    and RAM must hold at least its weights plus the runtime — unless `force` (an MoE model may
    still run by streaming its experts from disk)."""
    from .plan import RUNTIME_BYTES
    dest.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest).free
    if size > free:
        raise PullError(f"{name} is {size / 2**30:.2f} GiB but {dest} has {free / 2**30:.2f} GiB free")
    need = size + RUNTIME_BYTES
    if not force and need > 0.9 * available_ram:
        raise PullError(f"{name} needs at least {need / 2**30:.2f} GiB of RAM (its {size / 2**30:.2f} GiB of weights "
                        f"+ runtime) but {available_ram / 2**30:.2f} GiB is available: it would not run here. A "
                        f"mixture-of-experts model can stream its experts from disk: --force downloads it anyway")


def pull_hf(spec: str, progress=None, room=None) -> Path:
    """`room(filename, size)`: called before downloading; raises PullError to refuse."""
    try:
        from huggingface_hub import HfApi, hf_hub_url
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError as e:
        raise PullError(f"huggingface_hub is needed to pull from the hub: {e}") from None
    repo, filename, rev = parse_spec(spec)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))
    try:
        info = api.model_info(repo, revision=rev, files_metadata=True)
    except HfHubHTTPError as e:
        raise PullError(f"cannot read {repo}@{rev} from the hub: {e}") from None
    ggufs = {s.rfilename: s for s in (info.siblings or []) if s.rfilename.endswith(".gguf")}
    if filename is None:
        if len(ggufs) != 1:
            listed = ", ".join(sorted(ggufs)) or "none"
            raise PullError(f"{repo} has {len(ggufs)} GGUF files ({listed}); name one: hf:{repo}/FILE.gguf")
        filename = next(iter(ggufs))
    if filename not in ggufs:
        raise PullError(f"{repo}@{rev} has no file {filename!r} (GGUF files: {', '.join(sorted(ggufs)) or 'none'})")
    sib = ggufs[filename]
    expected = getattr(sib.lfs, "sha256", None) if sib.lfs else None
    size = getattr(sib.lfs, "size", None) or sib.size
    if not expected or not size:
        raise PullError(f"the hub gives no sha256/size for {filename}; refusing an unverifiable download")
    commit = info.sha or rev
    if room is not None:
        room(filename, size)
    repo_dir = _hub_cache() / ("models--" + repo.replace("/", "--"))
    blob = repo_dir / "blobs" / expected
    snap = repo_dir / "snapshots" / commit / filename
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        part = blob.with_name(expected + ".kiln-partial")
        _transfer(hf_hub_url(repo, filename, revision=commit, endpoint=os.environ.get("HF_ENDPOINT")),
                  part, size, progress)
        got = sha256_file(part)
        if got != expected:
            part.unlink()
            raise PullError(f"checksum mismatch for {repo}/{filename}: the hub says sha256 {expected}, the "
                            f"download has {got}; nothing was kept — pull again")
        os.replace(part, blob)
    snap.parent.mkdir(parents=True, exist_ok=True)
    if not snap.exists():
        snap.symlink_to(os.path.relpath(blob, snap.parent))
    from .integrity import manifest_path, write_manifest
    if not manifest_path(snap).exists():
        write_manifest(snap, f"hf:{repo}/{filename}@{commit}")
    (repo_dir / "refs").mkdir(exist_ok=True)
    if not rev.startswith(commit):
        (repo_dir / "refs" / rev.replace("/", "_")).write_text(commit)
    return snap
