"""Where an image's rows go in a prompt, as llama.cpp's mtmd places them (tools/mtmd/mtmd.cpp
mtmd_tokenizer): the chat template writes MARKER where each image is; the text between markers
is tokenized piece by piece (special tokens parsed, BOS before the first), and each marker becomes
the projector's image tokens around the encoder's rows:

    gemma3:    <start_of_image> [rows] <end_of_image>
    qwen2.5vl, qwen3vl: <|vision_start|> [rows] <|vision_end|>  (placed by M-RoPE: vision/mrope.py)
    idefics3:  per tile  <fake_token_around_image><row_R_col_C> [rows], "\\n" after each row but the
               last; then "\\n\\n" <fake_token_around_image><global-img> [overview rows]
               <fake_token_around_image>

An image row in the token list is a placeholder id (negative, never a vocabulary id) naming the
image and the row; MediaRows holds their embeddings. Equal images give equal ids, so a prompt
cache reuses what an earlier request computed for the same picture, and never for another.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np

MARKER = "<__media__>"            # where an image goes in a raw prompt (llama-server's, mtmd's default)
IMAGE = "\ue002"                   # where an image goes in a message's content (the front ends write it)
AROUND = {"gemma3": ("<start_of_image>", "<end_of_image>"),             # one image: its rows between these
          "qwen2.5vl_merger": ("<|vision_start|>", "<|vision_end|>"),
          "qwen3vl_merger": ("<|vision_start|>", "<|vision_end|>")}
_ROW_BITS = 20
MAX_ROWS = 1 << _ROW_BITS


class MediaRows:
    """Embeddings of image rows by placeholder id, the least recently used dropped past `budget`
    bytes (a prompt's rows are registered when it is read; 256 MiB holds ~100 Gemma 3 images, so
    a running prompt's rows are gone only under that many newer ones — then it is refused, naming
    the row). Request threads add while the scheduler's thread reads: one lock."""

    def __init__(self, budget: int = 256 << 20):
        self._lock = threading.Lock()
        self.budget, self.bytes = budget, 0
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._bidirectional: set[int] = set()
        # (across, down) of images whose rows an M-RoPE model places in 2D — kept past their
        # rows (a cache holding them still needs where they sat), the oldest dropped past GRIDS
        self._grids: OrderedDict[int, tuple[int, int]] = OrderedDict()

    GRIDS = 1 << 16

    def add(self, key: int, rows: np.ndarray, bidirectional: bool = False, grid: tuple | None = None) -> list[int]:
        """Hold `rows` under `key`; their placeholder ids. `bidirectional`: the text model's
        attention among these rows goes both ways (mtmd's non-causal decode: Gemma 3's images);
        `grid`: (across, down) the rows fill, row by row (Qwen2.5-VL's)."""
        with self._lock:
            if grid is not None:
                if grid[0] * grid[1] != len(rows):
                    raise ValueError(f"a grid of {grid[0]}×{grid[1]} for {len(rows)} image rows")
                self._grids[key] = (int(grid[0]), int(grid[1]))
                self._grids.move_to_end(key)
                while len(self._grids) > self.GRIDS:
                    self._grids.popitem(last=False)
            return self._add(key, rows, bidirectional)

    def grid(self, key: int) -> tuple[int, int]:
        """(across, down) of the image held under `key`: its grid, else one line of its rows."""
        with self._lock:
            if key in self._grids:
                return self._grids[key]
            if key in self._blocks:
                return len(self._blocks[key]), 1
        raise KeyError(f"image {key} is no longer known: send the image again")

    def ids_if_held(self, key: int, bidirectional: bool = False) -> list[int] | None:
        """The ids of rows held under `key` (refreshed as recently used), or None."""
        with self._lock:
            return self._add(key, self._blocks[key], bidirectional) if key in self._blocks else None

    def _add(self, key: int, rows: np.ndarray, bidirectional: bool) -> list[int]:
        if len(rows) >= MAX_ROWS:
            raise ValueError(f"an image of {len(rows)} rows is more than {MAX_ROWS - 1}")
        if bidirectional:
            self._bidirectional.add(key)
        if key not in self._blocks:
            self._blocks[key] = np.ascontiguousarray(rows, np.float32)
            self.bytes += rows.nbytes
            while self.bytes > self.budget and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= old.nbytes
        self._blocks.move_to_end(key)
        return [-((key << _ROW_BITS) | r) - 1 for r in range(len(rows))]

    def __contains__(self, token: int) -> bool:
        if token >= 0:
            return False
        key, r = divmod(-token - 1, MAX_ROWS)
        block = self._blocks.get(key)
        return block is not None and r < len(block)

    def spans(self, tokens: np.ndarray) -> list[tuple[int, int]]:
        """(first, end) of each run of one bidirectional image's rows in `tokens`."""
        out: list[tuple[int, int]] = []
        if not self._bidirectional:
            return out
        keys = [(-t - 1) >> _ROW_BITS if t < 0 else None for t in tokens.tolist()]
        i = 0
        while i < len(keys):
            j = i + 1
            if keys[i] is not None and keys[i] in self._bidirectional:
                while j < len(keys) and keys[j] == keys[i]:
                    j += 1
                if j - i > 1:
                    out.append((i, j))
            i = j
        return out

    def rows(self, tokens: np.ndarray) -> np.ndarray:
        """Embeddings (len(tokens), n) of placeholder ids (a KeyError names one not held)."""
        out = []
        with self._lock:
            for t in tokens.tolist():
                key, r = divmod(-t - 1, MAX_ROWS)
                if key not in self._blocks:
                    raise KeyError(f"image row {t} is no longer held; send the image again")
                out.append(self._blocks[key][r])
        return np.stack(out)


def image_key(encoder_digest: str, data: bytes, index: int) -> int:
    """40 bits naming one encoded square of one image under one mmproj."""
    h = hashlib.sha256(encoder_digest.encode() + index.to_bytes(4, "little") + data).digest()
    return int.from_bytes(h[:5], "little")


class ImageTokens:
    """The text model's ids for the projector's image markup (looked up as mtmd does: by a token's
    text), resolved once per (model, mmproj) pair — a ValueError names one the vocabulary lacks."""

    def __init__(self, tokenizer, projector: str):
        self.tok, self.projector = tokenizer, projector
        by_text: dict[bytes, int] = {}
        for i in range(tokenizer.vocab_size):
            by_text.setdefault(tokenizer.token_bytes(i), i)
        self._by_text = by_text
        if projector in AROUND:
            self.begin, self.end = (self.find(t) for t in AROUND[projector])
        else:
            self.fake, self.glob = self.find("<fake_token_around_image>"), self.find("<global-img>")
            self.nl, self.nlnl = self.find("\n"), self.find("\n\n")

    def find(self, text: str) -> int:
        tid = self._by_text.get(text.encode())
        if tid is None:
            raise ValueError(f"the text model has no {text!r} token, which a {self.projector} projector needs: "
                             f"the mmproj does not belong to this model")
        return tid

    def around(self, squares: list[list[int]], grid: tuple[int, int]) -> list[int]:
        """One image's ids: the markup around its squares' placeholder rows."""
        if self.projector in AROUND:
            return [self.begin, *squares[0], self.end]
        gx, gy = grid
        out: list[int] = []
        for y in range(gy):
            for x in range(gx):
                out += [self.fake, self.find(f"<row_{y + 1}_col_{x + 1}>"), *squares[y * gx + x]]
            if y != gy - 1:
                out.append(self.nl)
        return out + [self.nlnl, self.fake, self.glob, *squares[-1], self.fake]


def prompt_ids(tokenizer, text: str, images: list[list[int]], add_bos: bool | None = None) -> list[int]:
    """The prompt's ids: the text around each MARKER tokenized piece by piece (special tokens
    parsed), images[i] (an image's ids, ImageTokens.around) at the i-th marker, BOS first if the
    model adds one. A ValueError if markers and images do not pair up."""
    pieces = text.split(MARKER)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"the prompt has {len(pieces) - 1} image markers for {len(images)} images")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids += tokenizer.encode(piece, special=True, add_bos=False)
        if i < len(images):
            ids += images[i]
    bos = tokenizer.special.bos
    if (tokenizer.special.add_bos if add_bos is None else add_bos) and bos is not None:
        ids = [bos] + ids
    return ids


def whole_images(spans, pos: int, n: int) -> int:
    """A prefill chunk of n rows from `pos`, moved so that it does not end inside an image whose
    rows attend both ways (`spans`: their (first, end); they must share one forward, as in
    llama.cpp's one batch): it stops before the image, or, starting at one, takes all of it."""
    end = pos + n
    for s, e in spans or ():
        if s < end < e:
            return s - pos if s > pos else e - pos
    return n
