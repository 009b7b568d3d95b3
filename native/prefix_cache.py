"""A prefix cache shared by a worker's sequences and kept on disk: the keys and values of a
prompt's leading blocks of BLOCK positions, found again by what they hold.

A block's key chains its tokens to everything before it (blake2b of the parent's key and its
token ids), so one lookup per block finds the longest cached prefix of a prompt, whichever
conversation computed it. Two prompts that share a system prompt share its blocks; a worker
restarted, or another worker of the same model, reads them back from disk. The engine computes
a position's keys and values the same whether its prompt was run in one piece or in chunks
(batch invariance), so a block copied in is what prefilling would have made, bit for bit.

In RAM: the most recently used blocks under a byte budget. On disk: one file per block under
KILN_HOME/cache/prefix/MODEL-SHA256-KTYPE-VTYPE/, written by a background thread (tmp, then
rename), the least recently used deleted past a byte budget. A file names its model's sha256,
the cache types and shapes, its tokens and parent, and a sha256 of its rows: a file that is
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
import struct
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .kv_cache import KVCache

BLOCK = 64                   # positions per block: what a prompt's tail recomputes at most
RAM_CAP = 1 << 30            # "auto" RAM budget: one sequence's whole-context KV, at most this
MAGIC = b"KILNKVB\0"
VERSION = 1
_HEAD = struct.Struct("<8sII")          # magic, version, header length
MAX_HEADER = 64 * 1024


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
        """`layout`: what a block's rows are — model (its sha256, or a name when none is known:
        then nothing goes to disk), k_type, v_type, n_layer, n_head_kv, head_dim and
        block_bytes (a block's payload); see layout_of()."""
        self.layout = layout
        self.root = hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=16).digest()
        self.ram_bytes, self.disk_bytes = int(ram_bytes), int(disk_bytes)
        self.log = log or (lambda msg: print(f"kiln prefix cache: {msg}", file=sys.stderr))
        self.blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()     # key -> payload (uint8)
        self.held = 0
        self.lock = threading.Lock()
        self.counts = {"hits_ram": 0, "hits_disk": 0, "published": 0, "written": 0, "rejected": 0,
                       "reused_tokens": 0}
        self.dir = None
        if disk_dir is not None and disk_bytes > 0 and layout.get("model_sha256"):
            self.dir = Path(disk_dir) / f"{layout['model_sha256']}-{layout['k_type']}-{layout['v_type']}"
            self.dir.mkdir(parents=True, exist_ok=True)
            self._writes: queue.Queue = queue.Queue(maxsize=4096)
            threading.Thread(target=self._writer, name="kiln-prefix-writer", daemon=True).start()

    # -- the scheduler's side ---------------------------------------------------------------

    def extend(self, cache: KVCache, prompt: list[int], reuse: int) -> int:
        """Bring `cache` (which holds `reuse` positions of `prompt`) further along `prompt` with
        cached blocks, leaving at least one position to run; the positions it now holds."""
        n_blocks = (len(prompt) - 1) // BLOCK
        first = reuse // BLOCK
        if n_blocks <= first or cache.adapter is not None or not cache.can_rewind:
            return reuse
        keys = chain_keys(prompt, n_blocks, self.root)
        got = []
        for i in range(first, n_blocks):
            payload = self._get(keys[i], keys[i - 1] if i else None, prompt[i * BLOCK:(i + 1) * BLOCK])
            if payload is None:
                break
            got.append(payload)
        if not got or (first + len(got)) * BLOCK <= reuse:
            return reuse
        cache.truncate(first * BLOCK)
        for i, payload in enumerate(got):
            at = (first + i) * BLOCK
            cache.import_rows(prompt[at:at + BLOCK], payload)
        with self.lock:
            self.counts["reused_tokens"] += cache.n - reuse
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
                try:
                    self._writes.put_nowait((key, keys[i - 1] if i else None, cache.tokens[i * BLOCK:(i + 1) * BLOCK],
                                             payload))
                except queue.Full:
                    pass                       # the disk is behind: this block stays in RAM only
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

    def _get(self, key: bytes, parent: bytes | None, tokens: list[int]) -> np.ndarray | None:
        with self.lock:
            payload = self.blocks.get(key)
            if payload is not None:
                self.blocks.move_to_end(key)
                self.counts["hits_ram"] += 1
                return payload
        if self.dir is None:
            return None
        payload = self._read(key, parent, tokens)
        if payload is not None:
            self._put(key, payload)
            with self.lock:
                self.counts["hits_disk"] += 1
        return payload

    # -- disk --------------------------------------------------------------------------------

    def _header(self, key: bytes, parent: bytes | None, tokens: list[int], payload: np.ndarray) -> dict:
        return {"layout": self.layout, "key": key.hex(), "parent": parent.hex() if parent else None,
                "tokens": [int(t) for t in tokens], "payload_bytes": int(payload.nbytes),
                "payload_sha256": hashlib.sha256(payload).hexdigest()}

    def _writer(self) -> None:
        used = self._scan()
        while True:
            key, parent, tokens, payload = self._writes.get()
            path = self.dir / key.hex()
            head = json.dumps(self._header(key, parent, tokens, payload)).encode()
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            try:
                with open(tmp, "wb") as f:
                    f.write(_HEAD.pack(MAGIC, VERSION, len(head)) + head)
                    f.write(payload.data)
                os.replace(tmp, path)
            except OSError as e:
                self.log(f"cannot write {path}: {e}; the block stays in RAM only")
                tmp.unlink(missing_ok=True)
                continue
            with self.lock:
                self.counts["written"] += 1
            used += _HEAD.size + len(head) + payload.nbytes
            if used > self.disk_bytes:
                used = self._trim()

    def _scan(self) -> int:
        return sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file())

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

    def _read(self, key: bytes, parent: bytes | None, tokens: list[int]) -> np.ndarray | None:
        path = self.dir / key.hex()
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._reject(path, f"cannot be read ({e})")
        if len(raw) < _HEAD.size:
            return self._reject(path, "is shorter than its header")
        magic, version, n = _HEAD.unpack_from(raw)
        if magic != MAGIC or version != VERSION or not 0 < n <= MAX_HEADER or len(raw) < _HEAD.size + n:
            return self._reject(path, "is not a Kiln KV block of this version")
        try:
            head = json.loads(raw[_HEAD.size:_HEAD.size + n])
        except (ValueError, UnicodeDecodeError):
            return self._reject(path, "has a header that is not JSON")
        payload = np.frombuffer(raw, np.uint8, offset=_HEAD.size + n)
        want = {"layout": self.layout, "key": key.hex(), "parent": parent.hex() if parent else None,
                "tokens": [int(t) for t in tokens], "payload_bytes": self.layout["block_bytes"]}
        for field, value in want.items():
            if not isinstance(head, dict) or head.get(field) != value:
                return self._reject(path, f"is not this block ({field} differs: another model, cache type or prompt)")
        if payload.nbytes != self.layout["block_bytes"]:
            return self._reject(path, f"holds {payload.nbytes} bytes of rows, not {self.layout['block_bytes']} (truncated)")
        if hashlib.sha256(payload).hexdigest() != head.get("payload_sha256"):
            return self._reject(path, "does not match its checksum (damaged)")
        try:
            os.utime(path)                          # recently used: the last to be trimmed
        except OSError:
            pass
        return payload

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


def layout_of(cache: KVCache, model_sha256: str | None, model_name: str) -> dict:
    """What a block of `cache`'s rows is, for keys and file headers."""
    return {"model_sha256": model_sha256, "model": model_name if not model_sha256 else None,
            "k_type": cache.k_type.name, "v_type": cache.v_type.name, "n_layer": cache.n_layer,
            "n_head_kv": cache.n_head_kv, "head_dim": cache.head_dim, "block": BLOCK,
            "block_bytes": cache.row_bytes() * BLOCK}
