"""Reading GGUF files: a fast header parser and memory-mapped tensor views.

`gguf.GGUFReader` builds a numpy view per vocabulary string and needs ~5 s to open SmolLM2;
this parser reads the same metadata and tensor table with `struct.unpack_from` in a fraction of
that, and maps tensor data with `np.memmap` (nothing is read until a tensor is used).

Every failure is a `GGUFError` that names the file and what is wrong with it.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> (struct format, numpy dtype); 8 = string, 9 = array.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9

# One read-only mapping per file (path, inode, size, mtime), shared by the header parser and the
# tensor views while any of them is alive: two mappings of the same file count its resident
# pages twice in RSS (a loaded model read 209-270 MiB for the same memory), which `kiln ps` and
# the placer read.
_maps: "weakref.WeakValueDictionary[tuple, np.memmap]" = weakref.WeakValueDictionary()
_maps_lock = threading.Lock()


def _mapping(path: Path) -> np.memmap:
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    with _maps_lock:
        m = _maps.get(key)
        if m is None:
            m = np.memmap(path, dtype=np.uint8, mode="r")
            _maps[key] = m
        return m


class GGUFError(Exception):
    """A GGUF file could not be read; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]        # numpy order (outermost first): the reverse of ggml's ne
    offset: int                   # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class GGUFFile:
    """Metadata and tensor table of one GGUF file; tensor data is mapped on first use."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]          # in file order
    data_offset: int
    file_size: int
    _map: np.memmap | None = field(default=None, repr=False)
    private: Any = field(default=None, repr=False)     # PrivateWeights: tensors copied out of the mapping

    def copy_to_private(self, names) -> None:
        """Copy the tensors `names` into private memory in huge pages (native/private_weights.py);
        raw() gives those from the copy from then on, the others from the mapping."""
        from .private_weights import PrivateWeights
        self.private = PrivateWeights(self, names)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` as a zero-copy uint8 view into the file (or into
        the private copy, for the tensors `copy_to_private` took)."""
        info = self.tensor(name)
        if self.private is not None and name in self.private.arrays:
            return self.private.arrays[name]
        if self._map is None:
            self._map = _mapping(self.path)
        return self._map[info.offset: info.offset + info.n_bytes]

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing "
                            f"(the file has {len(self.tensors)} tensors; is it complete "
                            f"and of the architecture it claims, {self.architecture!r}?)") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reads over a buffer, with bounds errors that say where."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated header (needed {size} bytes at offset "
                            f"{self.pos}, file has {len(self.buf)}); re-download the file")
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > len(self.buf) - self.pos:
            raise GGUFError(f"{self.path}: string of {n} bytes at offset {self.pos} runs past the "
                            f"end of the file; the file is truncated or corrupt")
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def _skip_strings(self, count: int) -> None:
        """Step over `count` strings (a vocabulary: ~100k of them) without decoding them — the
        lengths read in a tight loop, as listing and planning models read every header."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                break
            pos += 8 + length(buf, pos)[0]
        else:
            if pos <= end:
                self.pos = pos
                return
        raise GGUFError(f"{self.path}: an array of {count} strings at offset {self.pos} runs past the "
                        f"end of the file; the file is truncated or corrupt")

    def value(self, vtype: int, skip_arrays: bool):
        if vtype in _SCALAR_TYPES:
            return self.unpack(_SCALAR_TYPES[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _SCALAR_TYPES:
                dtype = np.dtype(_SCALAR_TYPES[etype][1])
                nbytes = count * dtype.itemsize
                if self.pos + nbytes > len(self.buf):
                    raise GGUFError(f"{self.path}: array of {count} values at offset {self.pos} "
                                    f"runs past the end of the file; the file is truncated")
                arr = None if skip_arrays else np.frombuffer(self.buf, dtype, count, self.pos).copy()
                self.pos += nbytes
                return arr if arr is not None else _Skipped(count)
            if etype == _STRING:
                if skip_arrays:
                    self._skip_strings(count)
                    return _Skipped(count)
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(_ARRAY, skip_arrays) for _ in range(count)]
            raise GGUFError(f"{self.path}: unknown array element type {etype} at offset {self.pos}")
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at offset {self.pos}; "
                        f"the file is corrupt or from a newer GGUF version")


class _Skipped(list):
    """Placeholder for an array not loaded (skip_arrays=True); remembers its length."""

    def __init__(self, count: int):
        super().__init__()
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"<{self.count} values not loaded>"


def read_gguf(path: str | os.PathLike, *, skip_arrays: bool = False) -> GGUFFile:
    """Parse the header and tensor table of a GGUF file.

    skip_arrays=True leaves large arrays (vocabulary, merges) unread: enough for listing and
    planning, and several times faster.
    """
    path = Path(path)
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if path.is_dir():
        raise GGUFError(f"{path}: is a directory, not a GGUF file")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path}: not a GGUF file (only {size} bytes)")
    buf = _mapping(path)
    mv = memoryview(buf)
    if bytes(mv[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {bytes(mv[:4])!r}, expected b'GGUF')")
    cur = _Cursor(mv, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise GGUFError(f"{path}: implausible header ({n_tensors} tensors, {n_kv} keys); corrupt")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"), skip_arrays)

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions; corrupt")
        ne = [cur.unpack("<Q") for _ in range(n_dims)]
        ttype, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, ne, ttype, offset))

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, ttype, offset in infos:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown type id {ttype}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_el = int(np.prod(ne)) if ne else 1
        if ne and ne[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} row of {ne[0]} is not a multiple of the "
                            f"{qtype.name} block size {block}; corrupt")
        n_bytes = n_el // block * type_size
        start = data_offset + offset
        if start + n_bytes > size:
            raise GGUFError(f"{path}: tensor {name!r} ends at byte {start + n_bytes} but the file "
                            f"has {size} bytes; the file is truncated (an interrupted download?)")
        tensors[name] = TensorInfo(name, qtype, tuple(int(d) for d in reversed(ne)), start, n_bytes)
    del mv
    return GGUFFile(path, version, metadata, tensors, data_offset, size)
