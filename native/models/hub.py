"""`kiln models pull hf.co/ORG/REPO:QUANT` (and the other forms of hub_refs.py).

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
from pathlib import Path

from .hub_refs import HubRef, best_mmproj, best_model, is_model, parse_ref, parts_of, registry_refusal, split_of, tags_in
from .library import PullError, sha256_file

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


def pull_hf(spec: str, progress=None, room=None, say=None) -> Path:
    """Fetch the files a hub reference names (hub_refs.py: a quant tag's file, every part of a
    split model, a vision model's projector) and return the model's path (its first part).
    `room(name, size)`: called with the total before downloading; raises PullError to refuse.
    `say(message)`: what was chosen, for the user."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError as e:
        raise PullError(f"huggingface_hub is needed to pull from the hub: {e}") from None
    ref = parse_ref(spec)
    if ref is None:
        raise PullError(registry_refusal(spec) or f"{spec!r} is not a Hugging Face model: give hf.co/ORG/REPO[:QUANT], "
                        f"ORG/REPO[:QUANT] or hf:ORG/REPO[/FILE.gguf][@REVISION]")
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))
    try:
        info = api.model_info(ref.repo, revision=ref.rev, files_metadata=True)
    except HfHubHTTPError as e:
        raise PullError(f"cannot read {ref.repo}@{ref.rev} from the hub: {e}") from None
    # a name that would leave the snapshot folder (../, /…) is no file of ours, whatever the hub says
    siblings = {s.rfilename: s for s in (info.siblings or []) if s.rfilename.lower().endswith(".gguf")
                and not s.rfilename.startswith("/") and ".." not in s.rfilename.split("/")}
    names = sorted(siblings)
    parts, mmproj = choose_files(ref, names)
    files = parts + ([mmproj] if mmproj else [])
    if say is not None:
        asked = ref.file or ref.tag or "no quant tag (Q4_K_M, else Q8_0, else the first model file)"
        say(f"{ref.repo}: {asked} → {parts[0]}" + (f" and its {len(parts) - 1} other parts" if len(parts) > 1 else "")
            + (f"; the vision projector {mmproj}" if mmproj else ""))
    sizes = {}
    for name in files:
        sib = siblings[name]
        expected = getattr(sib.lfs, "sha256", None) if sib.lfs else None
        sizes[name] = getattr(sib.lfs, "size", None) or sib.size
        if not expected or not sizes[name]:
            raise PullError(f"the hub gives no sha256/size for {name}; refusing an unverifiable download")
    commit = info.sha or ref.rev
    if room is not None:
        room(files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more", sum(sizes.values()))
    repo_dir = _hub_cache() / ("models--" + ref.repo.replace("/", "--"))
    paths = [_fetch(ref.repo, name, siblings[name].lfs.sha256, sizes[name], commit, repo_dir, progress)
             for name in files]
    (repo_dir / "refs").mkdir(exist_ok=True)
    if not ref.rev.startswith(commit):
        (repo_dir / "refs" / ref.rev.replace("/", "_")).write_text(commit)
    return paths[0]


def choose_files(ref: HubRef, names: list[str]) -> tuple[list[str], str | None]:
    """The files to fetch for `ref` among a repo's GGUF files: the model's (all its parts, in
    order) and its projector if the repo has one. PullError saying what there is when nothing
    matches."""
    if ref.file is not None:
        match = [n for n in names if n.lower() == ref.file.lower()]
        if not match:
            raise PullError(f"{ref.repo}@{ref.rev} has no file {ref.file!r} (GGUF files: {', '.join(names) or 'none'})")
        primary = match[0]
    else:
        primary = best_model(names, ref.tag)
        if primary is None:
            offered = ", ".join(tags_in(names)) or "none"
            raise PullError(f"{ref.repo}@{ref.rev} has no {ref.tag + ' ' if ref.tag else ''}GGUF model file "
                            f"(quantizations there: {offered}; GGUF files: {', '.join(names) or 'none'})")
    parts = parts_of(names, primary)
    want = split_of(primary).count
    if len(parts) != want:
        raise PullError(f"{primary} is part of a model split in {want}, but {ref.repo} has {len(parts)} of its "
                        f"parts: the split model is incomplete there")
    return parts, (best_mmproj(names, primary) if is_model(primary) else None)


def _fetch(repo: str, filename: str, expected: str, size: int, commit: str, repo_dir: Path, progress) -> Path:
    """One file into the hub cache's layout (blobs/<sha256>, snapshots/<commit>/<file>), resumed
    from a partial blob and verified before it appears; its manifest written."""
    blob = repo_dir / "blobs" / expected
    snap = repo_dir / "snapshots" / commit / filename
    if not blob.exists():
        from huggingface_hub import hf_hub_url
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
    return snap
