"""Model integrity: a manifest written when a model is pulled (sha256 of the file and of each
64 MiB chunk, size, source, date) beside the file, and `verify` against it — which names the
first chunk that differs, so a damaged download says where."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

CHUNK = 64 * 2**20
SUFFIX = ".kiln-manifest.json"


def manifest_path(model: Path) -> Path:
    return model.with_name(model.name + SUFFIX)


def hash_file(path: Path, progress=None) -> tuple[str, list[str], int]:
    """(sha256 of the file, sha256 of each CHUNK-byte chunk, size)."""
    whole, chunks, size = hashlib.sha256(), [], 0
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                break
            whole.update(block)
            chunks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
            if progress:
                progress(size)
    return whole.hexdigest(), chunks, size


def write_manifest(model: Path, source: str) -> Path:
    digest, chunks, size = hash_file(model)
    doc = {"file": model.name, "size": size, "sha256": digest, "chunk_bytes": CHUNK, "chunks": chunks,
           "source": source, "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = manifest_path(model)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out)
    return out


def verify(model: Path, progress=None) -> dict:
    """{"status": "ok" | "mismatch" | "unverified", …}. A mismatch carries the first chunk that
    differs as a byte range; a file without a manifest is hashed and reported unverified."""
    m = manifest_path(model)
    digest, chunks, size = hash_file(model, progress)
    out = {"model": str(model), "sha256": digest, "size": size}
    if not m.exists():
        return {**out, "status": "unverified", "reason": f"no manifest ({m.name}): it was not pulled by Kiln"}
    try:
        doc = json.loads(m.read_text())
    except (ValueError, OSError) as e:
        return {**out, "status": "unverified", "reason": f"the manifest cannot be read: {e}"}
    if digest == doc.get("sha256") and size == doc.get("size"):
        return {**out, "status": "ok", "source": doc.get("source"), "pulled_at": doc.get("pulled_at")}
    step = int(doc.get("chunk_bytes") or CHUNK)
    want = doc.get("chunks") or []
    bad = next((i for i in range(max(len(want), len(chunks)))
                if i >= len(want) or i >= len(chunks) or want[i] != chunks[i]), 0)
    start = bad * step
    end = min((bad + 1) * step, max(size, int(doc.get("size") or 0)))
    return {**out, "status": "mismatch", "expected_sha256": doc.get("sha256"), "expected_size": doc.get("size"),
            "first_bad_range": [start, end], "source": doc.get("source")}
