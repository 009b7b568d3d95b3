"""Reading GGUF files: a fast header parser and memory-mapped tensor views.

`gguf.GGUFReader` builds a numpy view per vocabulary string and needs ~5 s to open SmolLM2;
this parser reads the same metadata and tensor table with `struct.unpack_from` in a fraction of
that, and maps tensor data with `np.memmap` (nothing is read until a tensor is used).

The file may be hostile: every count, length, dimension and offset in it is checked against the
file's size before anything is allocated or looped over, and every failure is a `GGUFError`
that names the file, the field (a key or a tensor), the byte offset and what is wrong.
"""

from __future__ import annotations

import math
import os
import re
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
    offset: int                   # absolute byte offset of the data in its file
    n_bytes: int
    part: int = 0                 # which file of a split model holds it (GGUFFile.parts)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


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
    parts: tuple[Path, ...] = ()            # a split model's files, in order (path is the first)
    _part_maps: dict = field(default_factory=dict, repr=False)

    def file_of(self, info: "TensorInfo") -> Path:
        """The file holding a tensor's data (a split model's part)."""
        return self.parts[info.part] if self.parts else self.path

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
        if info.part:
            m = self._part_maps.get(info.part)
            if m is None:
                m = self._part_maps[info.part] = _mapping(self.parts[info.part])
            return m[info.offset: info.offset + info.n_bytes]
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
MAX_DIMS = 4                      # ggml's GGML_MAX_DIMS: a tensor has at most 4 dimensions
MAX_NAME = 63                     # ggml's GGML_MAX_NAME (64) less its NUL: a tensor name's bytes
MAX_KEY = 1024                    # a metadata key's bytes (real ones are under 100)
_MAX_NESTING = 2                  # arrays of arrays: llama.cpp reads none; deeper is corrupt
_SKIP_OVER = 4096                 # skip_arrays leaves longer arrays unread (vocabularies), not per-layer ones
# the fewest bytes one entry can take, to bound a count by the bytes left before looping
_MIN_KV = 8 + 4 + 1               # key length, value type, a 1-byte value
_MIN_TENSOR = 8 + 4 + 8 + 4 + 8   # name length, n_dims, one dimension, type, offset
_MIN_ARRAY = 4 + 8                # element type, count


class _Cursor:
    """Sequential little-endian reads over a buffer. Every count and length read from the file
    is checked against the bytes left (`bound`) before anything is allocated or looped over, and
    every error names the file, the field being read (`self.field`) and the byte offset."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.field = buf, 0, path, "header"

    def error(self, problem: str, at: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {self.field} (byte {self.pos if at is None else at}): {problem}")

    def bound(self, count: int, item_bytes: int, what: str, at: int | None = None) -> int:
        """`count` items of at least `item_bytes` each must fit in what is left of the file."""
        left = len(self.buf) - self.pos
        if count * item_bytes > left:
            raise self.error(f"{what} ({count:,} x {item_bytes} bytes) run past the end of the file, "
                             f"{left:,} bytes on; the file is truncated or corrupt (re-download it)", at)
        return count

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self.error(f"truncated header (needed {size} bytes, file has {len(self.buf)}); "
                             f"re-download the file")
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self, limit: int | None = None) -> str:
        """A length-prefixed UTF-8 string; `limit`: the most bytes a name may have (a garbage
        length would otherwise decode megabytes of tensor data into an error message)."""
        at = self.pos
        n = self.bound(self.unpack("<Q"), 1, "a string")
        if limit is not None and n > limit:
            raise self.error(f"a name of {n:,} bytes (at most {limit}); the file is corrupt", at)
        text = str(self.buf[self.pos: self.pos + n], "utf-8", "replace")       # no copy of the bytes first
        self.pos += n
        return text

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
        raise self.error(f"an array of {count} strings runs past the end of the file; the file is "
                         f"truncated or corrupt")

    def value(self, vtype: int, skip_arrays: bool, depth: int = 0):
        if vtype in _SCALAR_TYPES:
            return self.unpack(_SCALAR_TYPES[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            at = self.pos
            etype, count = self.unpack("<I"), self.unpack("<Q")
            skip = skip_arrays and count > _SKIP_OVER
            if etype in _SCALAR_TYPES:
                dtype = np.dtype(_SCALAR_TYPES[etype][1])
                nbytes = self.bound(count, dtype.itemsize, "an array") * dtype.itemsize
                arr = None if skip else np.frombuffer(self.buf, dtype, count, self.pos).copy()
                self.pos += nbytes
                return arr if arr is not None else _Skipped(count)
            if etype == _STRING:
                self.bound(count, 8, "an array of strings")
                if skip:
                    self._skip_strings(count)
                    return _Skipped(count)
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                if depth >= _MAX_NESTING:
                    raise self.error(f"arrays nested more than {_MAX_NESTING} deep; the file is corrupt", at)
                self.bound(count, _MIN_ARRAY, "an array of arrays")
                return [self.value(_ARRAY, skip_arrays, depth + 1) for _ in range(count)]
            raise self.error(f"unknown array element type {etype}; the file is corrupt", at)
        raise self.error(f"unknown metadata value type {vtype}; the file is corrupt or from a newer "
                         f"GGUF version", self.pos - 4)


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
    """Parse the header and tensor table of a GGUF file — of every part, for a model split as
    llama.cpp's gguf-split writes it (`NAME-00001-of-0000N.gguf`: the first part holds the
    metadata, each part `split.no`/`split.count` and some of the tensors; `path` is the first).

    skip_arrays=True leaves large arrays (over 4096 values: vocabulary, merges) unread: enough
    for listing and planning (which read per-layer arrays), and several times faster.
    """
    first = _read_one(Path(path), skip_arrays)
    count = first.metadata.get("split.count", 1)
    if count == 1 and "split.no" not in first.metadata:
        return first
    return _join_parts(first)


SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_PARTS = 9999                  # gguf-split's five digits


def _join_parts(first: GGUFFile) -> GGUFFile:
    """A split model as one: the first part's metadata, every part's tensors (each knowing its
    file); the parts found beside the first by name, each checked to be part i of the same n."""
    path, meta = first.path, first.metadata

    def bad(problem: str) -> GGUFError:
        return GGUFError(f"{path}: {problem}")
    count, no, total = meta.get("split.count"), meta.get("split.no"), meta.get("split.tensors.count")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (count, no, total)):
        raise bad("split.count, split.no and split.tensors.count must all be integers in a split model")
    if not 1 <= count <= MAX_PARTS or not 0 <= no < count or not 0 <= total <= 10**7:
        raise bad(f"split.no {no} of split.count {count} (split.tensors.count {total}) is not a part of a split model")
    if no != 0:
        raise bad(f"this is part {no + 1} of {count} of a split model: open the first part (-00001-of-{count:05d}.gguf)")
    m = SPLIT_NAME.match(path.name)
    if count > 1 and (m is None or int(m["no"]) != 1 or int(m["count"]) != count):
        raise bad(f"the first of {count} parts must be named NAME-00001-of-{count:05d}.gguf to find the others")
    parts, tensors, size = [path], dict(first.tensors), first.file_size
    for i in range(1, count):
        p = path.with_name(f"{m['prefix']}-{i + 1:05d}-of-{count:05d}.gguf")
        if not p.is_file():
            raise bad(f"part {i + 1} of {count} ({p.name}) is missing beside it: a split model needs all its parts")
        g = _read_one(p, skip_arrays=True)
        if g.metadata.get("split.no") != i or g.metadata.get("split.count") != count:
            raise GGUFError(f"{p}: says it is part {g.metadata.get('split.no')!r} of {g.metadata.get('split.count')!r}, "
                            f"expected part {i} of {count} (0-based) of {path.name}")
        for name, t in g.tensors.items():
            if name in tensors:
                raise GGUFError(f"{p}: tensor {name!r} is also in an earlier part; the split model is corrupt")
            tensors[name] = TensorInfo(t.name, t.type, t.shape, t.offset, t.n_bytes, part=i)
        parts.append(p)
        size += g.file_size
    if len(tensors) != total:
        raise bad(f"the {count} parts hold {len(tensors)} tensors, but split.tensors.count says {total}")
    return GGUFFile(path, first.version, meta, tensors, first.data_offset, size, parts=tuple(parts))


def _read_one(path: Path, skip_arrays: bool) -> GGUFFile:
    """The header and tensor table of one file."""
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
    cur.field = "header's metadata key count"
    cur.bound(n_kv, _MIN_KV, "the metadata keys", 16)
    cur.field = "header's tensor count"
    cur.bound(n_tensors, _MIN_TENSOR, "the tensors", 8)      # after the keys: checked again there

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        cur.field = f"metadata key #{i}"
        at = cur.pos
        key = cur.string(MAX_KEY)
        cur.field = f"metadata key {key!r}"
        if key in metadata:
            raise cur.error("the key appears twice; the file is corrupt", at)
        metadata[key] = cur.value(cur.unpack("<I"), skip_arrays)

    cur.field = "header's tensor count"
    cur.bound(n_tensors, _MIN_TENSOR, "the tensors", 8)
    infos = []
    for i in range(n_tensors):
        cur.field = f"tensor #{i}"
        at = cur.pos
        name = cur.string(MAX_NAME)
        cur.field = f"tensor {name!r}"
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.error(f"{n_dims} dimensions (a tensor has 1 to {MAX_DIMS}); the file is corrupt", cur.pos - 4)
        ne = [cur.unpack("<Q") for _ in range(n_dims)]
        ttype, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, ne, ttype, offset, at))

    cur.field = "metadata key 'general.alignment'"
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not (isinstance(alignment, int) and alignment > 0 and alignment & (alignment - 1) == 0):
        raise cur.error(f"alignment {alignment!r} is not a power of two; the file is corrupt")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, ttype, offset, at in infos:
        cur.field = f"tensor {name!r}"
        tensors[name] = _tensor_info(cur, name, ne, ttype, offset, at, data_offset, alignment, tensors)
    del mv
    return GGUFFile(path, version, metadata, tensors, data_offset, size)


def _tensor_info(cur: _Cursor, name: str, ne: list[int], ttype: int, offset: int, at: int, data_offset: int,
                 alignment: int, seen: dict) -> TensorInfo:
    """One tensor table entry checked against the file: a new name, a known type, dimensions
    whose product (exact: Python integers, not numpy's wrapping int64) fits from an aligned
    offset inside the data section."""
    size = len(cur.buf)
    if name in seen:
        raise cur.error("a second tensor of this name; the file is corrupt", at)
    try:
        qtype = GGMLQuantizationType(ttype)
    except ValueError:
        raise cur.error(f"unknown tensor type id {ttype}; the file is corrupt or needs a newer Kiln", at) from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if min(ne) < 1:
        raise cur.error(f"dimensions {ne} include {min(ne)} (each must be at least 1); the file is corrupt", at)
    if ne[0] % block:
        raise cur.error(f"row of {ne[0]} is not a multiple of the {qtype.name} block size {block}; corrupt", at)
    if offset % alignment:
        raise cur.error(f"data offset {offset} is not a multiple of the alignment {alignment}; corrupt", at)
    start = data_offset + offset
    n_bytes = math.prod(ne) // block * type_size
    if start + n_bytes > size:
        raise cur.error(f"{n_bytes:,} bytes of {qtype.name} {ne} from byte {start:,} end past the file's "
                        f"{size:,} bytes; the file is truncated (an interrupted download?) or corrupt", at)
    return TensorInfo(name, qtype, tuple(int(d) for d in reversed(ne)), start, n_bytes)
