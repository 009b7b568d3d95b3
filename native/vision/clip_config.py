"""What an mmproj file is (native/vision/encoder.py runs it): the `clip` GGUF as llama.cpp's mtmd
reads it (tools/mtmd/clip.cpp load_hparams, load_tensors) — its projector, the vision
transformer's shape, the preprocessing it asks for — each value checked as it is read, and the
shape of every tensor the encoder computes with checked before anything runs."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..arch.base import MAX_LAYERS, MAX_WIDTH
from ..config import Keys
from ..gguf_file import GGUFError, GGUFFile

QWEN25VL, QWEN3VL = "qwen2.5vl_merger", "qwen3vl_merger"
PROJECTORS = ("gemma3", "idefics3", QWEN25VL, QWEN3VL)      # what Kiln runs; llama.cpp knows ~50 more
MAX_IMAGE_SIDE = 4096                    # the encoder's own tile side (pixels); real ones are 224..896
_LAYER = re.compile(r"^v\.blk\.(\d+)\.")


def is_mmproj(g: GGUFFile) -> bool:
    return g.architecture == "clip"


@dataclass(frozen=True)
class VisionConfig:
    name: str
    projector: str           # gemma3 | idefics3 | qwen2.5vl_merger
    n_layer: int
    n_embd: int              # the vision transformer's width
    n_head: int
    n_ff: int
    eps: float
    image_size: int          # the side of the square the encoder sees (gemma3) or of a tile (idefics3)
    patch_size: int
    n_merge: int             # gemma3: the average pool's side; idefics3: the pixel shuffle's factor
    n_text: int              # the text model's width the projector maps to
    mean: tuple
    std: tuple
    longest_edge: int = 0    # idefics3: an image's longer side is resized to this, then cut in tiles
    ffn_swapped: bool = False   # legacy files: ffn_up and ffn_down stored under each other's names
    wa_pattern: int = 0      # qwen2.5vl: every wa_pattern-th layer attends over the whole image, the rest in windows
    min_pixels: int = 0      # qwen-vl: an image is resized to between these many pixels (mtmd's 8..4096 tokens)
    max_pixels: int = 0
    deepstack: tuple = ()    # qwen3vl: the layers whose output also goes to the text model's first layers

    @property
    def dynamic(self) -> bool:
        """Does the encoder take an image at (about) its own size, not squares of image_size?"""
        return self.projector in (QWEN25VL, QWEN3VL)

    @property
    def row_width(self) -> int:
        """Values in one text row it gives: the text model's width, and one more such slice per
        deepstack layer (Qwen3-VL's, added to the text model's first layers' outputs)."""
        return self.n_text * (1 + len(self.deepstack))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Embeddings one encoded square gives the text model."""
        return (self.patches_per_side // self.n_merge) ** 2


def read_vision_config(g: GGUFFile) -> VisionConfig:
    key = Keys(g, "clip")
    if not key("has_vision_encoder", False, required=False, kind=bool):
        key.fail("has_vision_encoder", g.metadata.get("clip.has_vision_encoder"),
                 "this mmproj has no vision encoder (an audio projector?); Kiln reads images only")
    proj = g.metadata.get("clip.projector_type") or g.metadata.get("clip.vision.projector_type")
    if proj not in PROJECTORS:
        raise GGUFError(f"{g.path}: projector type {str(proj)[:40]!r} is not one Kiln runs (it runs "
                        f"{', '.join(PROJECTORS)}: Gemma 3, SmolVLM/Idefics3, Qwen2.5-VL and Qwen3-VL vision)")
    if proj == QWEN3VL:
        if not key("use_gelu", False, required=False, kind=bool) or key("use_silu", False, required=False, kind=bool):
            key.fail("use_gelu", g.metadata.get("clip.use_gelu"), "a Qwen3-VL vision tower's FFN is GELU")
    elif proj == QWEN25VL:
        if not key("use_silu", False, required=False, kind=bool) or key("use_gelu", False, required=False, kind=bool):
            key.fail("use_silu", g.metadata.get("clip.use_silu"), "a Qwen2.5-VL vision tower's FFN is SwiGLU")
    elif key("use_silu", False, required=False, kind=bool) or not key("use_gelu", False, required=False, kind=bool):
        key.fail("use_gelu", g.metadata.get("clip.use_gelu"), f"a {proj} vision tower uses GELU")
    n_layer = key("vision.block_count", kind=int, lo=1, hi=4096)
    present = {int(m.group(1)) for n in g.tensors if (m := _LAYER.match(n))}
    if len(present) != n_layer or present != set(range(n_layer)):
        key.fail("vision.block_count", n_layer, f"the file holds {len(present)} vision layers")
    n_embd = key("vision.embedding_length", kind=int, lo=1, hi=MAX_WIDTH)
    n_head = key("vision.attention.head_count", kind=int, lo=1, hi=MAX_WIDTH)
    if n_embd % n_head:
        key.fail("vision.attention.head_count", n_head, f"must divide embedding_length, {n_embd}")
    if key("vision.attention.head_count_kv", n_head, required=False, kind=int) != n_head:
        key.fail("vision.attention.head_count_kv", g.metadata["clip.vision.attention.head_count_kv"],
                 "a SigLIP tower's key heads are its query heads")
    image_size = key("vision.image_size", kind=int, lo=1, hi=MAX_IMAGE_SIDE)
    if proj in (QWEN25VL, QWEN3VL):
        return _qwen_vl(g, key, proj, n_layer, n_embd, n_head, image_size)
    patch = key("vision.patch_size", kind=int, lo=1, hi=image_size)
    if image_size % patch:
        key.fail("vision.patch_size", patch, f"must divide image_size, {image_size}")
    merge = key("vision.projector.scale_factor", 4 if proj == "gemma3" else 0, required=False, kind=int, lo=1,
                hi=image_size // patch)
    if proj == "idefics3" and merge < 2:
        key.fail("vision.projector.scale_factor", merge, "idefics3's pixel shuffle needs a factor of 2 or more")
    if (image_size // patch) % merge:
        key.fail("vision.projector.scale_factor", merge, f"must divide the patches per side, {image_size // patch}")
    stats = _mean_std(g, key)
    n_ff = key("vision.feed_forward_length", kind=int, lo=1, hi=MAX_WIDTH)
    swapped = _swapped(g, n_embd, n_ff)
    if proj == "gemma3":
        n_text = _shape(g, "mm.input_projection.weight", 2)[1]
    else:
        n_text = _shape(g, "mm.model.fc.weight", 2)[0]
    return VisionConfig(
        name=str(g.metadata.get("general.name", g.path.stem))[:200], projector=proj, n_layer=n_layer,
        n_embd=n_embd, n_head=n_head, n_ff=n_ff,
        eps=key("vision.attention.layer_norm_epsilon", kind=float, lo=0.0, hi=1.0),
        image_size=image_size, patch_size=patch, n_merge=merge, n_text=n_text, mean=stats[0], std=stats[1],
        longest_edge=key("vision.preproc_image_size", 0, required=False, kind=int, lo=0, hi=MAX_IMAGE_SIDE * 8)
        if proj == "idefics3" else 0,
        ffn_swapped=swapped)


def _qwen_vl(g: GGUFFile, key: Keys, proj: str, n_layer: int, n_embd: int, n_head: int,
             image_size: int) -> VisionConfig:
    """Qwen2.5-VL's and Qwen3-VL's towers (clip.cpp's qwen2vl, qwen3vl graphs): patches of
    patch_size from an image of its own size (a multiple of 2 patches each way), 2×2 of them merged
    into one text row, 2D rope over a head's quarters — so a head's width must split in 4."""
    patch = key("vision.patch_size", kind=int, lo=1, hi=MAX_IMAGE_SIDE // 2)
    if key("vision.spatial_merge_size", 2, required=False, kind=int) != 2:
        key.fail("vision.spatial_merge_size", g.metadata["clip.vision.spatial_merge_size"],
                 "Qwen2.5-VL's merger joins 2×2 patches")
    if (n_embd // n_head) % 4:
        key.fail("vision.attention.head_count", n_head, f"a head's width, {n_embd // n_head}, must split in 4 "
                 f"for the 2D rope")
    stats = _mean_std(g, key)
    n_ff = key("vision.feed_forward_length", kind=int, lo=1, hi=MAX_WIDTH)
    area = (2 * patch) ** 2                        # pixels a text row covers
    deepstack = tuple(i for i in range(n_layer) if f"v.deepstack.{i}.fc1.weight" in g.tensors)
    if proj == QWEN3VL:
        side = int(round(np.sqrt(_shape(g, "v.position_embd.weight", 2)[0])))
        if side * side != g.tensor("v.position_embd.weight").shape[0] or side < 2:
            raise GGUFError(f"{g.path}: tensor 'v.position_embd.weight' has {g.tensor('v.position_embd.weight').shape[0]} "
                            f"positions: a Qwen3-VL table is a square of 2 or more a side; the file is corrupt")
    return VisionConfig(
        name=str(g.metadata.get("general.name", g.path.stem))[:200], projector=proj, n_layer=n_layer,
        n_embd=n_embd, n_head=n_head, n_ff=n_ff,
        eps=key("vision.attention.layer_norm_epsilon", kind=float, lo=0.0, hi=1.0),
        image_size=image_size, patch_size=patch, n_merge=2, n_text=_shape(g, "mm.2.bias", 1)[0],
        mean=stats[0], std=stats[1], ffn_swapped=_swapped(g, n_embd, n_ff),
        wa_pattern=key("vision.n_wa_pattern", kind=int, lo=0, hi=MAX_LAYERS) if proj == QWEN25VL else 0,
        min_pixels=8 * area, max_pixels=4096 * area, deepstack=deepstack)


def _swapped(g: GGUFFile, n_embd: int, n_ff: int) -> bool:
    return "v.blk.0.ffn_down.weight" in g.tensors and g.tensor("v.blk.0.ffn_down.weight").shape[-1] == n_embd \
        and n_ff != n_embd


def _mean_std(g: GGUFFile, key: Keys) -> list:
    stats = []
    for name in ("vision.image_mean", "vision.image_std"):
        v = g.metadata.get(f"clip.{name}")
        if not isinstance(v, (list, np.ndarray)) or len(v) < 3 or not all(
                isinstance(x, (int, float, np.number)) and np.isfinite(x) for x in v[:3]):
            key.fail(name, v, "must be 3 finite numbers")
        if name.endswith("std") and not all(x > 0 for x in v[:3]):
            key.fail(name, v, "must be 3 positive numbers")
        stats.append(tuple(np.float32(x) for x in v[:3]))
    return stats


def _shape(g: GGUFFile, name: str, dims: int) -> tuple:
    shape = g.tensor(name).shape                 # a missing tensor: named
    if len(shape) != dims or not all(0 < s <= MAX_WIDTH * 4 for s in shape):
        raise GGUFError(f"{g.path}: tensor {name!r} has shape {list(shape)}; the file is corrupt")
    return shape


def tensor_plan(g: GGUFFile, c: VisionConfig) -> tuple[dict, list]:
    """Every tensor the encoder reads with the shape clip.cpp's graph needs (numpy order: rows
    first), and which are matrices; optional biases and the pre-norm where the file has them."""
    if c.projector == QWEN25VL:
        return _checked(g, c, *_qwen25vl_plan(g, c))
    if c.projector == QWEN3VL:
        return _checked(g, c, *_qwen3vl_plan(g, c))
    d, f, p = c.n_embd, c.n_ff, c.patch_size
    want = {"v.patch_embd.weight": (d, 3, p, p), "v.position_embd.weight": (c.patches_per_side ** 2, d)}
    mats = ["v.patch_embd.weight"]
    for name in ("v.patch_embd.bias",):
        if name in g.tensors:
            want[name] = (d,)
    for t in ("pre_ln", "post_ln"):
        if f"v.{t}.weight" in g.tensors:
            want |= {f"v.{t}.weight": (d,)} | ({f"v.{t}.bias": (d,)} if f"v.{t}.bias" in g.tensors else {})
    up, down = ("ffn_down", "ffn_up") if c.ffn_swapped else ("ffn_up", "ffn_down")
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        for t, shape in (("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)), ("attn_out", (d, d)),
                         (up, (f, d)), (down, (d, f))):
            want[b + t + ".weight"] = shape
            mats.append(b + t + ".weight")
            if b + t + ".bias" in g.tensors:
                want[b + t + ".bias"] = (shape[0],)
        for t in ("ln1", "ln2"):
            want[b + t + ".weight"] = (d,)
            if b + t + ".bias" in g.tensors:
                want[b + t + ".bias"] = (d,)
    if c.projector == "gemma3":
        want |= {"mm.soft_emb_norm.weight": (d,), "mm.input_projection.weight": (d, c.n_text)}
    else:
        want["mm.model.fc.weight"] = (c.n_text, d * c.n_merge * c.n_merge)
        mats.append("mm.model.fc.weight")
    return _checked(g, c, want, mats)


def _qwen25vl_plan(g: GGUFFile, c: VisionConfig) -> tuple[dict, list]:
    d, f, p = c.n_embd, c.n_ff, c.patch_size
    want = {"v.patch_embd.weight": (d, 3, p, p), "v.patch_embd.weight.1": (d, 3, p, p)}
    mats = list(want)
    if "v.patch_embd.bias" in g.tensors:
        raise GGUFError(f"{g.path}: a Qwen2.5-VL patch embedding has no bias (clip.cpp refuses it too); the file "
                        f"is not one Kiln can run")
    up, down = ("ffn_down", "ffn_up") if c.ffn_swapped else ("ffn_up", "ffn_down")
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        for t, shape, bias in (("attn_q", (d, d), True), ("attn_k", (d, d), True), ("attn_v", (d, d), True),
                               ("attn_out", (d, d), False), ("ffn_gate", (f, d), False), (up, (f, d), False),
                               (down, (d, f), False)):
            want[b + t + ".weight"] = shape
            mats.append(b + t + ".weight")
            if bias or b + t + ".bias" in g.tensors:       # q, k, v's biases the graph adds unconditionally
                want[b + t + ".bias"] = (shape[0],)
        for t in ("ln1", "ln2"):
            want |= {b + t + ".weight": (d,)} | ({b + t + ".bias": (d,)} if b + t + ".bias" in g.tensors else {})
    return _qwen_merger(g, c, want, mats)


def _qwen3vl_plan(g: GGUFFile, c: VisionConfig) -> tuple[dict, list]:
    d, f, p, n = c.n_embd, c.n_ff, c.patch_size, g.tensor("v.position_embd.weight").shape[0]
    want = {"v.patch_embd.weight": (d, 3, p, p), "v.patch_embd.weight.1": (d, 3, p, p), "v.patch_embd.bias": (d,),
            "v.position_embd.weight": (n, d)}
    mats = ["v.patch_embd.weight", "v.patch_embd.weight.1"]
    up, down = ("ffn_down", "ffn_up") if c.ffn_swapped else ("ffn_up", "ffn_down")
    for i in range(c.n_layer):
        b = f"v.blk.{i}."
        for t, shape in (("attn_qkv", (3 * d, d)), ("attn_out", (d, d)), (up, (f, d)), (down, (d, f))):
            want |= {b + t + ".weight": shape, b + t + ".bias": (shape[0],)}
            mats.append(b + t + ".weight")
        for t in ("ln1", "ln2"):
            want |= {b + t + ".weight": (d,), b + t + ".bias": (d,)}
    for i in c.deepstack:
        b = f"v.deepstack.{i}."
        want |= {b + "norm.weight": (4 * d,), b + "norm.bias": (4 * d,), b + "fc1.weight": (4 * d, 4 * d),
                 b + "fc1.bias": (4 * d,), b + "fc2.weight": (c.n_text, 4 * d), b + "fc2.bias": (c.n_text,)}
        mats += [b + "fc1.weight", b + "fc2.weight"]
    return _qwen_merger(g, c, want, mats)


def _qwen_merger(g: GGUFFile, c: VisionConfig, want: dict, mats: list) -> tuple[dict, list]:
    """The norms around a Qwen tower, where the file has them, and its 2×2 merger MLP."""
    d = c.n_embd
    for t in ("pre_ln", "post_ln"):
        if f"v.{t}.weight" in g.tensors:
            want |= {f"v.{t}.weight": (d,)} | ({f"v.{t}.bias": (d,)} if f"v.{t}.bias" in g.tensors else {})
    want |= {"mm.0.weight": (4 * d, 4 * d), "mm.0.bias": (4 * d,), "mm.2.weight": (c.n_text, 4 * d),
             "mm.2.bias": (c.n_text,)}
    return want, mats + ["mm.0.weight", "mm.2.weight"]


def _checked(g: GGUFFile, c: VisionConfig, want: dict, mats: list) -> tuple[dict, list]:
    for name, shape in want.items():
        have = g.tensor(name).shape
        if tuple(have) != shape:
            raise GGUFError(f"{g.path}: tensor {name!r} has shape {list(have)}, expected {list(shape)} for this "
                            f"{c.projector} vision encoder (width {c.n_embd}, FFN {c.n_ff}, patch {c.patch_size}, "
                            f"image {c.image_size}); "
                            f"the file is corrupt")
    return want, mats
