"""Images as the vision encoder sees them: decoded from untrusted bytes with bounds, resized and
cut exactly as llama.cpp's mtmd does (tools/mtmd/mtmd-image.cpp: its resampler is Pillow's, ported —
so Pillow's resize gives the same bytes), scaled to [0, 1] and normalized by the mmproj's mean
and standard deviation.

    gemma3:    one square of image_size: the image fitted inside (aspect kept, bilinear), centred
               on black
    idefics3:  the longer side resized to longest_edge (Lanczos), both sides then rounded up to
               whole tiles; the tiles row by row, and the whole image shrunk to one tile (the
               overview, which the text sees last)
    qwen2.5vl: the image's own size rounded to whole 2×2 patches and kept between the
               projector's pixel limits (transformers' smart_resize, float32 as mtmd), the image
               fitted inside (bicubic), centred on black
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .clip_config import VisionConfig

MAX_PIXELS = 50_000_000          # larger images are refused before they are decoded
MAX_BYTES = 64 * 1024 * 1024     # an upload's size
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
F32 = np.float32


class ImageError(ValueError):
    """An image Kiln will not read: the message says what is wrong with it."""


@dataclass
class Tiles:
    """What one image becomes: the squares to encode (each (3, side, side) float32, planar RGB as
    clip.cpp lays its input out), and for a tiled projector the grid they came from — for a
    dynamic one (qwen2.5vl) the one image (3, h, w) and its grid of text rows (across, down)."""
    squares: list
    grid: tuple = (0, 0)            # (columns, rows) of tiles; (0, 0): one square, no overview
    overview: np.ndarray | None = None


def check_header(data: bytes, what: str = "image") -> tuple[int, int]:
    """(width, height) from the header alone — what an HTTP front end checks before the bytes go
    on to a worker — or an ImageError naming `what` and the problem."""
    return decode(data, what, header_only=True)


def decode(data: bytes, what: str = "image", header_only: bool = False):
    """A Pillow RGB image from untrusted bytes, or an ImageError naming `what` and the problem.
    The size is read from the header and checked before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageError(f"{what}: empty — send the image's bytes (base64 in JSON)")
    if len(data) > MAX_BYTES:
        raise ImageError(f"{what}: {len(data)} bytes is over the {MAX_BYTES >> 20} MiB limit")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            w, h = img.size
            if w < 1 or h < 1 or w * h > MAX_PIXELS:
                raise ImageError(f"{what}: {w}×{h} pixels is over the {MAX_PIXELS // 1_000_000} megapixel limit")
            if header_only:
                return w, h
            img.seek(0)                     # an animation: its first frame, as llama.cpp's stb_image
            rgb = img.convert("RGB")
            rgb.load()
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{what}: not an image Kiln reads ({', '.join(FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{what}: {str(e)[:160]}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:       # truncated or corrupt data
        raise ImageError(f"{what}: the image data is corrupt: {str(e)[:120]}") from None
    return rgb


def _resize(img, size: tuple[int, int], algo: str):
    from PIL import Image
    if img.size == tuple(size):
        return img.copy()
    f = {"bilinear": Image.Resampling.BILINEAR, "lanczos": Image.Resampling.LANCZOS,
         "bicubic": Image.Resampling.BICUBIC}[algo]
    return img.resize(size, f)


def _fit(img, size: tuple[int, int], algo: str):
    """mtmd's resize with PAD_CEIL to size (w, h): aspect kept (float32 arithmetic, sides rounded
    up), centred on black."""
    from PIL import Image
    w, h = img.size
    tw, th = size
    if (w, h) == (tw, th):
        return img.copy()
    scale = min(F32(tw) / F32(w), F32(th) / F32(h))
    nw, nh = min(int(math.ceil(F32(w) * scale)), tw), min(int(math.ceil(F32(h) * scale)), th)
    out = Image.new("RGB", (tw, th), (0, 0, 0))
    out.paste(_resize(img, (nw, nh), algo), ((tw - nw) // 2, (th - nh) // 2))
    return out


def smart_size(w: int, h: int, align: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(w, h) rounded to multiples of `align`, scaled into [min_pixels, max_pixels] with the aspect
    about kept — mtmd's calc_size_preserved_ratio, its float32 arithmetic and std::round (half away
    from zero) included."""
    f = F32(align)

    def by(x, op):
        return int(op(np.float64(F32(x) / f))) * align
    rnd = lambda v: math.floor(v + 0.5)            # noqa: E731  (x ≥ 0: half away from zero)
    wb, hb = max(align, by(w, rnd)), max(align, by(h, rnd))
    if wb * hb > max_pixels:
        beta = np.sqrt(F32(F32(h) * F32(w)) / F32(max_pixels), dtype=F32)
        hb, wb = max(align, by(F32(h) / beta, math.floor)), max(align, by(F32(w) / beta, math.floor))
    elif wb * hb < min_pixels:
        beta = np.sqrt(F32(min_pixels) / F32(F32(h) * F32(w)), dtype=F32)
        hb, wb = by(F32(h) * beta, math.ceil), by(F32(w) * beta, math.ceil)
    return wb, hb


def normalize(img, c: VisionConfig) -> np.ndarray:
    """(3, h, w) float32: each byte / 255, minus the mean, over the std (clip_image_f32's order)."""
    a = np.asarray(img, np.uint8).astype(F32) / F32(255.0)
    a = (a - np.asarray(c.mean, F32)) / np.asarray(c.std, F32)
    return np.ascontiguousarray(a.transpose(2, 0, 1))


def preprocess(img, c: VisionConfig, what: str = "image") -> Tiles:
    if c.projector == "gemma3":
        return Tiles([normalize(_fit(img, (c.image_size, c.image_size), "bilinear"), c)])
    if c.dynamic:
        tw, th = smart_size(*img.size, 2 * c.patch_size, c.min_pixels, c.max_pixels)
        if tw * th > c.max_pixels:     # a side floored at one block: a 1,000,000×1 image became 1,792,000×28
            raise ImageError(f"{what}: {img.size[0]}×{img.size[1]} pixels is too long and thin for this model "
                             f"(it would be {tw // (2 * c.patch_size)}×{th // (2 * c.patch_size)} rows, over "
                             f"its {c.max_pixels // (2 * c.patch_size) ** 2}); crop it")
        side = 2 * c.patch_size                    # the grid: text rows across and down
        return Tiles([normalize(_fit(img, (tw, th), "bicubic"), c)], (tw // side, th // side))
    return _idefics3(img, c)


def _idefics3(img, c: VisionConfig) -> Tiles:
    tile = c.image_size
    w, h = img.size
    edge = c.longest_edge or tile
    aspect = w / h                                 # double, as mtmd
    if w >= h:
        rw, rh = edge, int(edge / aspect)
        rh += rh % 2
    else:
        rw, rh = int(edge * aspect), edge
        rw += rw % 2
    rw, rh = max(rw, 1), max(rh, 1)
    gx, gy = -(-rw // tile), -(-rh // tile)
    refined = _resize(_resize(img, (rw, rh), "lanczos"), (gx * tile, gy * tile), "lanczos")
    overview = _resize(refined, (tile, tile), "lanczos")
    squares = [normalize(refined.crop((x * tile, y * tile, (x + 1) * tile, (y + 1) * tile)), c)
               for y in range(gy) for x in range(gx)]
    return Tiles(squares, (gx, gy), normalize(overview, c))
