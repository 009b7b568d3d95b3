"""Where a row sits for an M-RoPE text model (Qwen2-VL, Qwen2.5-VL): three positions — time,
height, width — as llama.cpp's mtmd gives them (mtmd_image_tokens_get_decoder_pos, MROPE):

    text row at cache index i          (p, p, p) with p = i + delta
    image row r of an nx × ny grid     (p0, p0 + r // nx, p0 + r % nx), p0 the position of its
                                       first row
    after an image                     the next text row is p0 + max(nx, ny): an image takes
                                       max(nx, ny) positions for its nx·ny rows (delta moves)

So positions part from the cache index after the first image. The attention stays causal by
index (llama.cpp's 2D causal mask among an image's rows is raster order, which is index order).
A cache keeps (index, delta) of what it holds (KVCache.position_memo) so that a decode step walks
only its own token; a cache rolled back walks again from its start."""

from __future__ import annotations

import numpy as np

from .layout import MAX_ROWS


def positions(media, cache, tokens, split: bool = False) -> np.ndarray:
    """The positions of `tokens` appended to `cache`: (T,) when they are text only — the one
    position each — else (T, 3), each row's (time, height, width). `split`: the model's later
    layers run in other processes, which place rows by their cache index — refused past an image."""
    memo = cache.position_memo
    at, delta = memo if memo is not None and memo[0] <= cache.n else (0, 0)
    delta = _delta_after(media, cache.tokens[at:cache.n], delta)
    cache.position_memo = (cache.n, delta)
    toks = np.asarray(tokens, np.int64)
    if split and (delta or (toks < 0).any()):
        raise ValueError("a model split across processes does not take images placed by M-RoPE yet")
    if not (toks < 0).any():
        return np.arange(cache.n, cache.n + len(toks)) + delta
    out = np.empty((len(toks), 3), np.int64)
    for j, t in enumerate(toks.tolist()):
        i = cache.n + j
        if t >= 0:
            out[j] = i + delta
            continue
        key, r = divmod(-t - 1, MAX_ROWS)
        nx, ny = media.grid(key)
        p0 = i - r + delta
        out[j] = (p0, p0 + r // nx, p0 + r % nx)
        if r == nx * ny - 1:
            delta += max(nx, ny) - nx * ny
    return out


def stack(positions: list[np.ndarray]) -> np.ndarray:
    """Several runs' positions as one array: (T,) if all are, else each as (T, 3)."""
    if all(p.ndim == 1 for p in positions):
        return np.concatenate(positions)
    return np.concatenate([p if p.ndim == 2 else np.repeat(p[:, None], 3, 1) for p in positions])


def _delta_after(media, tokens: list[int], delta: int) -> int:
    """delta once `tokens` (already placed) are passed: each image whose last row is among them
    moves it."""
    arr = np.asarray(tokens, np.int64)
    for t in arr[arr < 0].tolist():
        key, r = divmod(-t - 1, MAX_ROWS)
        nx, ny = media.grid(key)
        if r == nx * ny - 1:
            delta += max(nx, ny) - nx * ny
    return delta


def section_of_pairs(sections: tuple, half: int, interleaved: bool = False) -> np.ndarray:
    """Which of the four positions (0 t, 1 h, 2 w, 3 e — e is 0 for every row llama.cpp places)
    turns each of a head's `half` pairs — ggml's mrope sectors: pair k in sector k mod
    sum(sections), sections laid end to end; `interleaved` (Qwen3-VL's IMRoPE): t, h, w taking
    turns while each section lasts (sector mod 3), the rest e."""
    sector = np.arange(half) % sum(sections)
    if interleaved:
        out = np.full(half, 3)
        for which, turn in ((1, 1), (2, 2), (0, 0)):            # ggml's order of the tests
            take = (sector % 3 == turn) & (sector < 3 * sections[which]) & (out == 3)
            out[take] = which
        return out
    return np.searchsorted(np.cumsum(sections), sector, side="right").clip(0, 3)
