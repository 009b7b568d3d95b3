"""A prefix cache shared by a worker's sequences and kept on disk: the keys and values of a
prompt's leading blocks of BLOCK positions, found again by what they hold.

A block's key chains its tokens to everything before it (blake2b of the parent's key and its
token ids), so one lookup per block finds the longest cached prefix of a prompt, whichever
conversation computed it. Two prompts that share a system prompt share its blocks; a worker
restarted, or another worker of the same model, reads them back from disk. The engine computes
a position's keys and values the same whether its prompt was run in one piece or in chunks
(batch invariance), so a block copied in is what prefilling would have made, bit for bit.

In RAM: the most recently used blocks under a byte budget. On disk: one file per block under
KILN_HOME/cache/prefix/MODEL-ID-KTYPE-VTYPE/, written by a background thread (tmp, then
rename), the least recently used deleted past a byte budget. A file names its model (sha256 or
fingerprint), the cache types and shapes, its tokens and parent, and a sha256 of its rows (native/kv_file.py),
read straight into the cache and committed only when it checks out: a file that is
not exactly the block asked for — another model's, truncated, a flipped bit, garbage — is
ignored with a log line, deleted, and the positions computed instead. Only what a plain run of
a prompt holds is published: no adapter's keys, nothing after a context shift; caches with
sliding-window or recurrent layers (which drop or fold positions) are not cached here.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from . import kv_file
from .kv_cache import KVCache

BLOCK = 32                   # positions per block: what a prompt's tail recomputes at most
RAM_CAP = 1 << 30            # "auto" RAM budget: one sequence's whole-context KV, at most this
WRITE_BEHIND = 256 << 20     # blocks waiting for the disk, at most (bytes)


def chain_keys(tokens: list[int], n_blocks: int, root: bytes) -> list[bytes]:
    """The keys of the first n_blocks blocks of `tokens`: each the digest of its parent's key and
    its own token ids (root: the model and cache types, so no two layouts share a key)."""
    keys, parent = [], root
    arr = np.asarray(tokens[:n_blocks * BLOCK], dtype="<i4")
    for i in range(n_blocks):
        parent = hashlib.blake2b(parent + arr[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, layout: dict, ram_bytes: int, disk_dir: Path | None = None, disk_bytes: int = 0,
                 log=None):
        """`layout`: what a block's rows are — model_id (the file's sha256 or fingerprint, or None:
        then nothing goes to disk), k_type, v_type, n_layer, n_head_kv, head_dim and
        block_bytes (a block's payload); see layout_of()."""
        self.layout = layout
        self.root = hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=16).digest()
        self.ram_bytes, self.disk_bytes = int(ram_bytes), int(disk_bytes)
        self.log = log or (lambda msg: print(f"kiln prefix cache: {msg}", file=sys.stderr))
        self.blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()     # key -> payload (uint8)
        self.held = 0
        self.lock = threading.Lock()
        self.counts = {"hits_ram": 0, "hits_disk": 0, "published": 0, "written": 0, "not_written": 0,
                       "rejected": 0, "reused_tokens": 0}
        self.dir = None
        if disk_dir is not None and disk_bytes > 0 and layout.get("model_id"):
            folder = Path(disk_dir) / f"{layout['model_id']}-{layout['k_type']}-{layout['v_type']}"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                self.dir = folder
            except OSError as e:           # a read-only or full home: the cache works in RAM
                self.log(f"cannot use {folder} ({e.strerror or e}); prompts are cached in RAM only")
        if self.dir is not None:
            self._writes: queue.Queue = queue.Queue()
            self.queued = 0                     # bytes waiting for the disk (held beside the RAM budget)
            threading.Thread(target=self._writer, name="kiln-prefix-writer", daemon=True).start()

    # -- the scheduler's side ---------------------------------------------------------------

    def extend(self, cache: KVCache, prompt: list[int], reuse: int) -> int:
        """Bring `cache` (which holds `reuse` positions of `prompt`) further along `prompt` with
        cached blocks, leaving at least one position to run; the positions it now holds. Blocks
        on disk are read straight into the cache's rows and checked there (a bad one is left
        uncommitted, and the positions from it on are computed)."""
        n_blocks = (len(prompt) - 1) // BLOCK
        first = reuse // BLOCK
        if n_blocks <= first or cache.adapter is not None or not cache.can_rewind:
            return reuse
        keys = chain_keys(prompt, n_blocks, self.root)
        last = first
        while last < n_blocks and (keys[last] in self.blocks or self._on_disk(keys[last])):
            last += 1
        if last * BLOCK <= reuse:
            return reuse
        cache.truncate(first * BLOCK)
        cache.reserve(last * BLOCK)
        for i in range(first, last):
            toks = prompt[i * BLOCK:(i + 1) * BLOCK]
            with self.lock:
                payload = self.blocks.get(keys[i])
                if payload is not None:
                    self.blocks.move_to_end(keys[i])
                    self.counts["hits_ram"] += 1
            if payload is not None:
                cache.import_rows(toks, payload)
            elif not self._read_into(cache, keys[i], keys[i - 1] if i else None, toks):
                break
        with self.lock:
            self.counts["reused_tokens"] += max(0, cache.n - reuse)
        return cache.n

    def publish(self, cache: KVCache) -> int:
        """Keep the cache's whole blocks of plainly computed positions; how many were new."""
        if cache.adapter is not None or not cache.can_rewind:
            return 0
        n_blocks = cache.exact // BLOCK
        keys = chain_keys(cache.tokens, n_blocks, self.root)
        new = 0
        for i, key in enumerate(keys):
            with self.lock:
                if key in self.blocks:
                    self.blocks.move_to_end(key)
                    continue
            payload = cache.export_rows(i * BLOCK, (i + 1) * BLOCK)
            self._put(key, payload)
            if self.dir is not None and not (self.dir / key.hex()).exists():
                with self.lock:                # a slow disk may hold back at most WRITE_BEHIND bytes
                    room = self.queued + payload.nbytes <= WRITE_BEHIND
                    if room:
                        self.queued += payload.nbytes
                if room:
                    self._writes.put((key, keys[i - 1] if i else None, cache.tokens[i * BLOCK:(i + 1) * BLOCK], payload))
                else:
                    with self.lock:
                        self.counts["not_written"] += 1     # the disk is behind: this block stays in RAM only
            new += 1
        with self.lock:
            self.counts["published"] += new
        return new

    def stats(self) -> dict:
        with self.lock:
            return {**self.counts, "blocks": len(self.blocks), "ram_bytes": self.held, "ram_budget": self.ram_bytes,
                    "disk": str(self.dir) if self.dir else None, "block_tokens": BLOCK}

    # -- RAM ---------------------------------------------------------------------------------

    def _put(self, key: bytes, payload: np.ndarray) -> None:
        if payload.nbytes > self.ram_bytes:
            return
        with self.lock:
            if key in self.blocks:
                return
            self.blocks[key] = payload
            self.held += payload.nbytes
            while self.held > self.ram_bytes:
                _, old = self.blocks.popitem(last=False)
                self.held -= old.nbytes

    # -- disk --------------------------------------------------------------------------------

    def _header(self, key: bytes, parent: bytes | None, tokens: list[int]) -> dict:
        return {"layout": self.layout, "key": key.hex(), "parent": parent.hex() if parent else None,
                "tokens": [int(t) for t in tokens]}

    def _writer(self) -> None:
        used = self._scan()
        while True:
            key, parent, tokens, payload = self._writes.get()
            path = self.dir / key.hex()
            try:
                used += kv_file.write(path, self._header(key, parent, tokens), payload)
            except OSError as e:
                self.log(f"cannot write {path}: {e}; the block stays in RAM only")
                continue
            finally:
                with self.lock:
                    self.queued -= payload.nbytes
            with self.lock:
                self.counts["written"] += 1
            if used > self.disk_bytes:
                used = self._trim()

    def _scan(self) -> int:
        try:
            return sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file())
        except OSError:
            return 0

    def _trim(self) -> int:
        """Delete the least recently used block files until the folder is under 90 % of its budget."""
        files = []
        for p in self.dir.iterdir():
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        files.sort()
        used = sum(s for _, s, _ in files)
        for _, size, p in files:
            if used <= 0.9 * self.disk_bytes:
                break
            p.unlink(missing_ok=True)
            used -= size
        return used

    def _on_disk(self, key: bytes) -> bool:
        return self.dir is not None and (self.dir / key.hex()).is_file()

    def _read_into(self, cache: KVCache, key: bytes, parent: bytes | None, tokens: list[int]) -> bool:
        """Read a block file into the cache's next rows and commit them — only when its header
        is this block's and its rows are whole and match their checksum."""
        path = self.dir / key.hex()
        want = {**self._header(key, parent, tokens), "payload_bytes": self.layout["block_bytes"]}
        try:
            with open(path, "rb") as f:
                head = kv_file.read_header(f, want)
                # the file's rows are position-major (export_rows'); read whole, checked, then
                # copied into the cache's head-major buffers (import_rows)
                payload = bytearray(self.layout["block_bytes"])
                if f.readinto(payload) != len(payload):
                    raise kv_file.KVFileError("holds fewer rows than its header says (truncated)")
                if f.read(1):
                    raise kv_file.KVFileError("holds more bytes than its header says")
            if hashlib.sha256(payload).hexdigest() != head.get("payload_sha256"):
                raise kv_file.KVFileError("does not match its checksum (damaged)")
        except FileNotFoundError:
            return False
        except OSError as e:
            self._reject(path, f"cannot be read ({e.strerror or e})")
            return False
        except kv_file.KVFileError as e:
            self._reject(path, str(e))
            return False
        cache.import_rows(tokens, payload)
        try:
            os.utime(path)                          # recently used: the last to be trimmed
        except OSError:
            pass
        with self.lock:
            self.counts["hits_disk"] += 1
        return True

    def _reject(self, path: Path, why: str) -> None:
        self.log(f"ignored {path}: it {why}; those positions are computed instead")
        with self.lock:
            self.counts["rejected"] += 1
        try:
            path.unlink()
        except OSError:
            pass
        return None


def auto_ram_bytes(kv_bytes_per_sequence: int) -> int:
    """The RAM a prefix cache takes by default (and the memory plan counts)."""
    return min(RAM_CAP, kv_bytes_per_sequence)


def layout_of(cache: KVCache, model_id: str | None, model_name: str) -> dict:
    """What a block of `cache`'s rows is, for keys and file headers."""
    return {"model_id": model_id, "model": model_name if not model_id else None,
            "k_type": cache.k_type.name, "v_type": cache.v_type.name, "n_layer": cache.n_layer,
            "n_head_kv": cache.n_head_kv, "head_dim": cache.head_dim, "block": BLOCK,
            "block_bytes": cache.row_bytes() * BLOCK}
