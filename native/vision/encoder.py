"""The vision encoder of an mmproj file as llama.cpp's mtmd runs it (tools/mtmd/models/siglip.cpp,
clip.cpp build_inp / build_vit): an image square becomes rows the text model reads in place of
token embeddings.

    x = patches(square) · patch_embd + patch bias + position_embd        (a stride-p convolution)
    per layer:  x += out(attn(LayerNorm1(x)));  x += down(gelu(up(LayerNorm2(x))))
    x = post LayerNorm(x)
    gemma3:    average pool n_merge × n_merge patches, RMS norm × soft_emb_norm, · input_projection
    idefics3:  pixel shuffle (each n_merge × n_merge block of patches one row) · fc

Attention is bidirectional over the square's patches, in the order ggml computes it
(kernels.encoder_attention, the BERT encoders' kernel). Products of F16 weights round the
activations to F16 as ggml's do (the patches included: im2col writes F16).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np

from .. import kernels
from ..blocks import rms_norm
from ..gguf_file import read_gguf
from ..kernels import Q, Weight, matmul, matmul_many
from . import qwen_vl
from .attention import patch_attention
from .clip_config import is_mmproj, read_vision_config, tensor_plan
from .images import Tiles, decode, preprocess

F32 = np.float32


class VisionEncoder:
    """A loaded mmproj: `config`, `encode(square) -> (tokens, n_text)`, `encode_image(tiles)`."""

    def __init__(self, path: str | os.PathLike, *, threads: int | None = None):
        t0 = time.perf_counter()
        self.path = Path(path)
        self.gguf = g = read_gguf(self.path)
        if not is_mmproj(g):
            from ..gguf_file import GGUFError
            raise GGUFError(f"{self.path}: architecture {g.architecture!r} is not an mmproj (clip) file; a vision "
                            f"model's projector is the separate mmproj-*.gguf beside it")
        self.config = c = read_vision_config(g)
        want, mats = tensor_plan(g, c)
        kernels_ = ("v.patch_embd.weight", "v.patch_embd.weight.1")    # convolutions: (n_embd, 3·p·p) matrices
        mats = [m for m in mats if m not in kernels_]
        self.w = kernels.load_weights(g, mats, threads or min(4, os.cpu_count() or 1))
        self.v = {n: kernels.load_vector(g, n) for n in want if n not in self.w and n not in
                  (*kernels_, "mm.input_projection.weight")}
        self.patch = _as_matrix(g, "v.patch_embd.weight", c.n_embd)
        if c.dynamic:                    # Qwen2.5-VL's second temporal kernel
            self.patch1 = _as_matrix(g, "v.patch_embd.weight.1", c.n_embd)
        if c.projector == "gemma3":      # ggml multiplies by its transpose, made contiguous (same type)
            self.proj = _transposed(g, "mm.input_projection.weight")
        self.up, self.down = ("ffn_down", "ffn_up") if c.ffn_swapped else ("ffn_up", "ffn_down")
        with open(self.path, "rb") as f:   # the file's identity: cached image embeddings are keyed by it
            self.digest = hashlib.sha256(f.read(1 << 20) + str(self.path.stat().st_size).encode()).hexdigest()[:16]
        self.load_seconds = time.perf_counter() - t0

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.w.values()) + sum(a.nbytes for a in self.v.values()) + self.patch.nbytes \
            + (self.patch1.nbytes if self.config.dynamic else 0)

    def _b(self, x: np.ndarray, name: str) -> np.ndarray:
        b = self.v.get(name)
        if b is not None:
            x += b
        return x

    def _ln(self, x: np.ndarray, name: str) -> np.ndarray:
        w = self.v[name + ".weight"]
        return kernels.layer_norm(x, w, self.v.get(name + ".bias", np.zeros_like(w)), self.config.eps)

    def tower(self, square: np.ndarray) -> np.ndarray:
        """The vision transformer's output (patches, n_embd) for one (3, side, side) square."""
        c = self.config
        s, p = c.image_size, c.patch_size
        if square.shape != (3, s, s):
            raise ValueError(f"a square must be (3, {s}, {s}), not {square.shape}")
        n = c.patches_per_side
        # im2col: each patch's channels, then rows, then columns — the kernel's (3, p, p) order
        cols = square.reshape(3, n, p, n, p).transpose(1, 3, 0, 2, 4).reshape(n * n, 3 * p * p)
        x = self._b(matmul(np.ascontiguousarray(cols, F32), self.patch), "v.patch_embd.bias")
        x = x + self.v["v.position_embd.weight"]
        if "v.pre_ln.weight" in self.v:
            x = self._ln(x, "v.pre_ln")
        H, d = c.n_head, c.head_dim
        scale = F32(1) / np.sqrt(F32(d))
        for i in range(c.n_layer):
            b = f"v.blk.{i}."
            h = self._ln(x, b + "ln1")
            q, k, v = (self._b(y, b + t + ".bias") for y, t in zip(
                matmul_many(h, [self.w[b + t + ".weight"] for t in ("attn_q", "attn_k", "attn_v")]),
                ("attn_q", "attn_k", "attn_v")))
            a = patch_attention(q, k, v, H, scale)
            x = self._b(matmul(a, self.w[b + "attn_out.weight"]), b + "attn_out.bias") + x
            h = self._ln(x, b + "ln2")
            h = kernels.gelu(self._b(matmul(h, self.w[b + self.up + ".weight"]), b + self.up + ".bias"), in_place=True)
            x = x + self._b(matmul(h, self.w[b + self.down + ".weight"]), b + self.down + ".bias")
        if "v.post_ln.weight" in self.v:
            x = self._ln(x, "v.post_ln")
        return x

    def encode(self, square: np.ndarray) -> np.ndarray:
        """(tokens_per_tile, n_text) float32: what the text model reads for one square (for a
        dynamic projector: the image's rows, one per 2×2 patches)."""
        c = self.config
        if c.dynamic:
            return qwen_vl.encode(self, square)
        x = self.tower(square)
        n, m = c.patches_per_side, c.n_merge
        if c.projector == "gemma3":
            g = x.reshape(n // m, m, n // m, m, c.n_embd)
            acc = np.zeros((n // m, n // m, c.n_embd), F32)
            for dy in range(m):                     # ggml_pool_2d's order: rows, then columns, then / k²
                for dx in range(m):
                    acc += g[:, dy, :, dx]
            pooled = (acc / F32(m * m)).reshape(-1, c.n_embd)
            return matmul(rms_norm(pooled, self.v["mm.soft_emb_norm.weight"], c.eps), self.proj)
        shuffled = x.reshape(n // m, m, n // m, m, c.n_embd).transpose(0, 2, 1, 3, 4).reshape(-1, m * m * c.n_embd)
        return matmul(np.ascontiguousarray(shuffled), self.w["mm.model.fc.weight"])

    def encode_image(self, tiles: Tiles) -> list[np.ndarray]:
        """Each square's embeddings in the order the text sees them: tiles row by row, then the
        overview (idefics3); the one square (gemma3)."""
        out = [self.encode(s) for s in tiles.squares]
        if tiles.overview is not None:
            out.append(self.encode(tiles.overview))
        return out

    def read(self, data: bytes, what: str = "image") -> Tiles:
        """Untrusted bytes to the squares this encoder takes (an ImageError if they are not an image)."""
        return preprocess(decode(data, what), self.config, what)


def _as_matrix(g, name: str, rows: int) -> Weight:
    """A tensor of any rank as a (rows, rest) weight over the same stored bytes."""
    info = g.tensor(name)
    raw = g.raw(name).reshape(rows, -1)
    w = Weight(name, info.type, (rows, int(np.prod(info.shape[1:]))), raw)
    if not w.compiled:
        w.dense
    return w


def _transposed(g, name: str) -> Weight:
    info = g.tensor(name)
    a = kernels.load_vector(g, name).T
    if info.type == Q.F16:
        raw = np.ascontiguousarray(a.astype(np.float16)).view(np.uint8)
        w = Weight(name + ".T", Q.F16, a.shape, raw)
        if not w.compiled:
            w.dense
        return w
    return Weight(name + ".T", Q.F32, a.shape, np.ascontiguousarray(a, F32).view(np.uint8), np.ascontiguousarray(a, F32))


def load_vision(path: str | os.PathLike, **kw) -> VisionEncoder:
    from ..gguf_file import GGUFError
    try:
        return VisionEncoder(path, **kw)
    except (OSError, ValueError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path}: cannot load mmproj: {e}") from e
