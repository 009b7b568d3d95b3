"""Per-sequence KV cache: keys and values of every layer for positions 0..n-1.

Grows in chunks; can be truncated to a prefix so that a follow-up turn reuses the shared part.
Keys and values are fp16 by default, as llama.cpp stores them (half the memory and traffic of
float32, and the rounding llama.cpp's outputs carry); q8_0 and q4_0 (kv_types.py) hold them in
ggml's blocks for 1.9× and 3.6× less memory; float32 is there for comparisons. Keys and values
may be of different types, as llama.cpp's -ctk/-ctv allow.
"""

from __future__ import annotations

import itertools
import secrets

import numpy as np

from .kernels import kv_store
from .kv_types import DEFAULT_KV_TYPE, check_head_dim, decode, kv_type, rotation

_CHUNK = 256
CHECKPOINTS = 2            # recurrent states kept per sequence (checkpoint())
KV_DTYPE = np.dtype(np.float16)        # what a cache holds unless told otherwise


_uids = itertools.count()
_PROCESS = secrets.token_hex(4)        # a cache's uid is unique across processes and restarts


class KVCache:
    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, max_tokens: int,
                 dtype=DEFAULT_KV_TYPE, recurrent: dict | None = None, windows: dict | None = None,
                 v_dtype=None, held: range | None = None):
        """dtype: the keys' type (a kv_types name such as "q8_0", or np.float16/np.float32);
        v_dtype: the values' (default: the keys'). `held`: the layers this cache keeps (a
        pipeline stage's, native/stages.py); the others get no room. `uid` names the sequence
        to the next stage, which keeps the rest of its layers."""
        self.uid = f"{_PROCESS}-{next(_uids)}"
        self.held = held if held is not None else range(n_layer)
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.k_type = kv_type(dtype)
        self.v_type = kv_type(v_dtype if v_dtype is not None else dtype)
        for t in (self.k_type, self.v_type):
            check_head_dim(t, head_dim)
        self.types = (self.k_type.name, self.v_type.name)
        # a quantized cache's rows are stored rotated, as llama.cpp stores them (kv_types.py)
        self.k_rot, self.v_rot = rotation(self.k_type, head_dim, True), rotation(self.v_type, head_dim, False)
        self.max_tokens = max_tokens
        self.n = 0                         # positions filled
        self.adapter = None                # the LoRA the keys/values were computed with
        self.tokens: list[int] = []        # the token at each filled position
        self.position_memo = None          # an M-RoPE model's (index, delta) here (native/vision/mrope.py)
        # leading positions that hold what a plain run of their tokens gives (after a context
        # shift the later ones saw tokens since dropped: no other prompt may reuse them)
        self.exact = 0
        self._cap = 0
        self._k: list[np.ndarray] = []
        self._v: list[np.ndarray] = []
        # recurrent layers (linear attention): their state after position n-1, by layer
        self._recurrent_shapes = recurrent or {}
        # sliding-window layers: layer -> window; they keep only the keys a query can still see,
        # rows from position _off[layer] on, in buffers of their own
        self._windows = windows or {}
        self._off = {i: 0 for i in self._windows}
        self._wk: dict[int, np.ndarray] = {}
        self._wv: dict[int, np.ndarray] = {}
        self._states: dict[int, dict[str, np.ndarray]] = {}
        # recurrent layers: their states at a few earlier positions (checkpoint()), so that a
        # prompt that leaves this one's path after such a position restarts there, not from zero
        self._checkpoints: dict[int, dict[int, dict[str, np.ndarray]]] = {}

    def recurrent_state(self, layer: int) -> dict[str, np.ndarray]:
        """The state arrays of a recurrent layer (zero before the first token), updated in place."""
        st = self._states.get(layer)
        if st is None:
            st = self._states[layer] = {k: np.zeros(shape, np.float32)
                                        for k, shape in self._recurrent_shapes[layer].items()}
        return st

    def _reserve(self, total: int) -> None:
        if total > self.max_tokens:
            raise ValueError(f"context full: {total} tokens exceed the context size {self.max_tokens}")
        if total <= self._cap:
            return
        cap = min(self.max_tokens, max(total, self._cap + _CHUNK, -(-total // _CHUNK) * _CHUNK))
        # a recurrent layer keeps a state instead of keys and values: no room for it
        skip = set(self._recurrent_shapes) | set(self._windows) | (set(range(self.n_layer)) - set(self.held))
        # one buffer at a time, each old one let go as soon as it is copied: the cache's peak is
        # its size plus one layer's, not twice its size (all new buffers beside all old ones)
        for bufs, t in ((self._k, self.k_type), (self._v, self.v_type)):
            for i in range(self.n_layer):
                new = self._rows(t, 0 if i in skip else cap)
                if i < len(bufs):
                    if len(new):
                        new[:self.n] = bufs[i][:self.n]
                    bufs[i] = new
                else:
                    bufs.append(new)
        self._cap = cap

    def _rows(self, t, n: int) -> np.ndarray:
        """Room for n positions of type t: (n, n_head_kv, head_dim / t.block) elements, each KV
        head's positions together in memory (head-major), seen position-first so that slicing
        by positions reads as before; the kernels read through the strides (csrc/kiln.h KvView).
        A decode step walks one KV head's keys, then its values, from position 0: one stream
        each, not 256 B of every 2 KiB row (Qwen3-0.6B Q4_K_M decode after 2,000 positions
        20.7 -> 22.8 tok/s, after 512 31.0 -> 30.0, in one process, alternating)."""
        return np.empty((self.n_head_kv, n, self.head_dim // t.block), t.dtype).transpose(1, 0, 2)

    def _write(self, kb: np.ndarray, vb: np.ndarray, at: int, k: np.ndarray, v: np.ndarray) -> None:
        kv_store(self.k_type, k, kb[at:at + k.shape[0]], self.k_rot)
        kv_store(self.v_type, v, vb[at:at + v.shape[0]], self.v_rot)

    def begin(self, tokens: list[int]) -> None:
        """Make room for `tokens` about to be appended at positions n..n+len-1."""
        self._reserve(self.n + len(tokens))

    def store(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v (T, Hkv, d) at positions n..n+T-1 of `layer`; return the keys and values
        of positions 0..n+T-1."""
        T = k.shape[0]
        self._write(self._k[layer], self._v[layer], self.n, k, v)
        return self._k[layer][:self.n + T], self._v[layer][:self.n + T]

    def store_window(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """As store() for a sliding-window layer: (keys, values, start) where the arrays begin at
        an absolute position off and `start` = n - off is the first new row's index in them.
        Positions no query from n on can see (before n - window + 1) are dropped first, so the
        layer holds at most window + T rows: memory bounded by the window, not the context."""
        T = k.shape[0]
        kb, vb, start = self.window_room(layer, T)
        self._write(kb, vb, start, k, v)
        return kb[:start + T], vb[:start + T], start

    def window_room(self, layer: int, T: int) -> tuple[np.ndarray, np.ndarray, int]:
        """A sliding-window layer's whole key and value buffers with room for T new rows from
        index `start` (position n), the rows no query from n on can see dropped — for
        store_window, or a compiled step that writes the rows itself."""
        W = self._windows[layer]
        off = self._off[layer]
        # drop whole groups of 8 positions: the attention kernels sum scores and values in lanes
        # by position mod 8, so the rows kept are summed exactly as with nothing dropped
        keep_from = max(off, (self.n - W + 1) // 8 * 8)
        kb, vb = self._wk.get(layer), self._wv.get(layer)
        have = self.n - off                                       # rows held now
        drop = keep_from - off
        need = have - drop + T
        if kb is None or need > len(kb) or len(kb) > 2 * max(need, W + _CHUNK):   # grow, or give back
            cap = max(need, W + _CHUNK)
            nk, nv = self._rows(self.k_type, cap), self._rows(self.v_type, cap)
            if kb is not None and have - drop > 0:
                nk[:have - drop], nv[:have - drop] = kb[drop:have], vb[drop:have]
            kb, vb = self._wk[layer], self._wv[layer] = nk, nv
        elif drop > 0:
            kb[:have - drop], vb[:have - drop] = kb[drop:have].copy(), vb[drop:have].copy()
        self._off[layer] = keep_from
        return kb, vb, self.n - keep_from

    def layer_buffers(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole key and value arrays of `layer` (capacity, Hkv, elements), for a compiled step
        that writes position n itself (after begin())."""
        return self._k[layer], self._v[layer]

    def commit(self, tokens: list[int]) -> None:
        if self.exact == self.n:
            self.exact += len(tokens)
        self.n += len(tokens)
        self.tokens.extend(tokens)

    def checkpoint(self) -> None:
        """Keep the recurrent layers' states at this position (a prompt's end: the next turn of
        its conversation may leave this path right after it). The newest CHECKPOINTS are kept."""
        if not self._recurrent_shapes or self.exact != self.n or self.n == 0 or self.n in self._checkpoints:
            return
        self._checkpoints[self.n] = {i: {k: a.copy() for k, a in st.items()} for i, st in self._states.items()}
        while len(self._checkpoints) > CHECKPOINTS:
            del self._checkpoints[min(self._checkpoints)]

    def truncate(self, n: int) -> None:
        """Forget every position from n on. A recurrent state cannot be rolled back: with
        recurrent layers only n == 0 (start over), n >= the filled positions, or a position
        with a checkpoint are possible."""
        if self._recurrent_shapes and 0 < n < self.n:
            if n not in self._checkpoints:
                raise ValueError(f"a recurrent state cannot be rolled back from {self.n} to {n} positions")
            self._states = {i: {k: a.copy() for k, a in st.items()} for i, st in self._checkpoints[n].items()}
        if n < self.n:
            self._checkpoints = {p: st for p, st in self._checkpoints.items() if p <= n}
        if n == 0:
            self._states.clear()
            self._off = {i: 0 for i in self._windows}
        elif n < self.n and any(n < off for off in self._off.values()):
            raise ValueError(f"a sliding-window layer no longer holds position {n}")
        self.n = min(self.n, n)
        self.exact = min(self.exact, self.n)
        del self.tokens[self.n:]
        if self.position_memo is not None and self.position_memo[0] > self.n:
            self.position_memo = None

    @property
    def can_rewind(self) -> bool:
        """Can positions just written be forgotten (truncate)? Not with a recurrent state, nor
        with sliding-window layers that drop keys as they go."""
        return not self._recurrent_shapes and not self._windows

    @property
    def whole(self) -> bool:
        """Does it keep every layer (not a pipeline stage's share)? Only a whole cache's rows can
        be exported, imported or shifted: another process holds the rest."""
        return len(self.held) == self.n_layer

    def row_bytes(self) -> int:
        """Bytes one position takes in every layer that keeps keys and values."""
        kv_layers = self.n_layer - len(self._recurrent_shapes) - len(self._windows)
        return kv_layers * self.n_head_kv * (self.k_type.row_bytes(self.head_dim) + self.v_type.row_bytes(self.head_dim))

    def export_rows(self, a: int, b: int) -> np.ndarray:
        """Positions a..b-1 of every layer, keys then values, as one uint8 array (a prefix
        cache's block, native/prefix_cache.py). Only for caches that keep every position."""
        if not self.can_rewind or not self.whole or not 0 <= a <= b <= self.n:
            raise ValueError(f"positions {a}..{b - 1} cannot be exported from a cache of {self.n}")
        return np.concatenate([np.ascontiguousarray(buf[a:b]).view(np.uint8).reshape(-1)
                               for i in range(self.n_layer) for buf in (self._k[i], self._v[i])])

    def reserve(self, total: int) -> None:
        """Room for `total` positions at once (a prefix cache bringing in many blocks: one
        allocation, not one per chunk)."""
        self._reserve(total)

    def import_rows(self, tokens: list[int], payload) -> None:
        """Append len(tokens) positions whose rows export_rows() gave (same model, same types):
        position-major bytes, copied into this cache's head-major buffers."""
        T = len(tokens)
        payload = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload.view(np.uint8).reshape(-1)
        if not self.can_rewind or not self.whole or payload.nbytes != T * self.row_bytes():
            raise ValueError(f"{payload.nbytes} bytes are not {T} positions of this cache")
        self._reserve(self.n + T)
        at = 0
        for i in range(self.n_layer):
            for buf in (self._k[i], self._v[i]):
                dst = buf[self.n:self.n + T]
                size = dst.size * dst.itemsize
                dst[...] = payload[at:at + size].view(buf.dtype).reshape(dst.shape)
                at += size
        self.commit(tokens)

    @property
    def can_shift(self) -> bool:
        """Can the context shift (shift())? Not with a recurrent state, nor with sliding-window
        layers (they keep only their window's rows), nor on a pipeline stage's share."""
        return self.can_rewind and self.whole

    def shift(self, n_keep: int, n_discard: int, rope_keys) -> None:
        """llama-server's context shift: forget positions n_keep .. n_keep+n_discard-1 and move
        every later one down by n_discard. `rope_keys(layer, keys)` turns those keys (float32,
        (T, Hkv, head_dim), unrotated) back by n_discard positions in place — what llama.cpp's
        K-shift does to them (a quantized row: decoded, turned, encoded again). The rows after
        n_keep now hold what tokens since dropped made: no later prompt reuses them."""
        if not self.can_shift:
            raise ValueError("the context cannot shift: this model's sliding-window or recurrent layers "
                             "do not keep every position's keys")
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > self.n:
            raise ValueError(f"a context shift drops positions {n_keep}..{n_keep + n_discard - 1} "
                             f"of the {self.n} held")
        src, end = n_keep + n_discard, self.n
        rows = end - src
        for i in range(self.n_layer):
            kb, vb = self._k[i], self._v[i]
            if not len(kb):
                continue
            k = np.ascontiguousarray(decode(kb[src:end], self.k_rot))
            rope_keys(i, k)
            kv_store(self.k_type, k, kb[n_keep:n_keep + rows], self.k_rot)
            vb[n_keep:n_keep + rows] = vb[src:end].copy()
        self.n -= n_discard
        del self.tokens[n_keep:src]
        self.exact = min(self.exact, n_keep)
        self.position_memo = None

    def copy_from(self, other: "KVCache") -> None:
        """Become a copy of `other` (same model): the n sequences of one request share the
        prompt's keys, values and recurrent states, computed once."""
        if other.types != self.types:
            raise ValueError(f"a cache of {'/'.join(self.types)} cannot copy one of {'/'.join(other.types)}")
        self.n, self.tokens, self.adapter, self._cap = other.n, list(other.tokens), other.adapter, other._cap
        self.exact, self.position_memo = other.exact, other.position_memo
        # order "K": a copy keeps the head-major layout (_rows), not numpy's default C order
        self._k = [a.copy(order="K") for a in other._k]
        self._v = [a.copy(order="K") for a in other._v]
        self._off = dict(other._off)
        self._wk = {i: a.copy(order="K") for i, a in other._wk.items()}
        self._wv = {i: a.copy(order="K") for i, a in other._wv.items()}
        self._states = {i: {k: a.copy() for k, a in st.items()} for i, st in other._states.items()}
        self._checkpoints = {}

    def common_prefix(self, tokens: list[int], adapter=None) -> int:
        """How many leading positions can be reused for `tokens` run with `adapter`."""
        if adapter is not self.adapter:
            return 0
        n = 0
        for a, b in zip(self.tokens[:self.exact], tokens):
            if a != b:
                break
            n += 1
        if self._recurrent_shapes and (n < self.n or n >= len(tokens)):
            # recurrent layers: an exact extension of what is cached, else the latest checkpoint
            # on the shared path that leaves a token to run
            return max((p for p in self._checkpoints if p <= n and p < len(tokens)), default=0)
        if n < self.n and any(n - w + 1 < self._off[i] for i, w in self._windows.items()):
            return 0               # a window layer dropped keys the shorter prefix's next query needs
        return n

    @property
    def nbytes(self) -> int:
        kv_layers = self.n_layer - len(self._recurrent_shapes) - len(self._windows)
        states = sum(a.nbytes for st in [*self._states.values(), *(s for c in self._checkpoints.values()
                                                                    for s in c.values())] for a in st.values())
        windows = sum(a.nbytes for a in list(self._wk.values()) + list(self._wv.values()))
        row = self.k_type.row_bytes(self.head_dim) + self.v_type.row_bytes(self.head_dim)
        return kv_layers * self._cap * self.n_head_kv * row + states + windows
