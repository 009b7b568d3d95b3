"""Vision against llama.cpp's own mtmd (tests/tools/make_tiny_vision.py made the references with
llama-cpp-python's libmtmd): each image's embeddings for a Gemma 3, an Idefics3 (SmolVLM) and a
Qwen2.5-VL projector, the prompt's layout of image rows between the model's image tokens, the
logits after the image and the greedy continuation — Gemma 3's image rows attending to each other
both ways, Qwen2.5-VL's placed by M-RoPE;
hostile images and mmproj files refused naming what is wrong."""

import hashlib
import json
import struct
import zlib

import numpy as np
import pytest

from conftest import DATA
from gguf_copy import copy_gguf
from kiln.native.gguf_file import GGUFError
from kiln.native.model import load_model
from kiln.native.vision import ImageError, decode, load_vision
from kiln.native.vision.clip_config import QWEN25VL
from kiln.native.vision.layout import MARKER, ImageTokens, image_key, prompt_ids

VISION = DATA / "vision"
REF = json.loads((VISION / "references.json").read_text())
NPZ = np.load(VISION / "references.npz")
CASES = {c["key"]: c for c in REF["cases"]}


def cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def loaded():
    out = {}
    for name in ("tiny-smolvlm", "tiny-gemma3v", "tiny-qwen25vl", "tiny-qwen3vl"):
        proj = {"tiny-smolvlm": "smolvlm", "tiny-gemma3v": "gemma3", "tiny-qwen25vl": "qwen25vl",
                "tiny-qwen3vl": "qwen3vl"}[name]
        out[name] = (load_model(VISION / f"{name}.gguf"), load_vision(VISION / f"mmproj-tiny-{proj}.gguf"))
    return out


def read_prompt(model, enc, case, rows=None):
    """The case's prompt ids with its image's rows: the encoder's, or `rows` (mtmd's own)."""
    data = (VISION / case["image"]).read_bytes()
    tiles = enc.read(data)
    # rows given: keyed by their content (another test's rows for this image must not be reused)
    whose = enc.digest if rows is None else hashlib.sha256(b"".join(r.tobytes() for r in rows)).hexdigest()
    rows = enc.encode_image(tiles) if rows is None else rows
    grid = tiles.grid if enc.config.dynamic else None
    squares = [model.media.add(image_key(whose, data, i), r, enc.config.projector == "gemma3", grid)
               for i, r in enumerate(rows)]
    ids = prompt_ids(model.tokenizer, case["prompt"], [ImageTokens(model.tokenizer, enc.config.projector)
                                                       .around(squares, tiles.grid)])
    return rows, ids


def greedy_after(model, ids, n):
    cache = model.new_cache(256)
    logits, out = model.forward(ids, cache), []
    first = logits
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], cache)
    return first, out


@pytest.mark.parametrize("key", sorted(CASES))
def test_image_embeddings_and_text_after_match_mtmd(loaded, qwen_as_llama_cpp_runs_it, key):
    """llama.cpp's bits: each image's rows, and the logits after the prompt and the greedy text
    (Qwen2.5-VL: with the RMS epsilon llama.cpp runs it with; with the file's, the same greedy text)."""
    case = CASES[key]
    model, enc = loaded[case["model"][:-5]]
    rows, ids = read_prompt(model, enc, case)
    assert len(rows) == sum("image" in c for c in case["chunks"])
    for i, r in enumerate(rows):
        assert np.array_equal(r, NPZ[f"{key}/image{i}"]), (i, np.abs(r - NPZ[f"{key}/image{i}"]).max())
    layout = [t for c in case["chunks"] for t in (c["text"] if "text" in c else ["image"] * c["image"])]
    assert ["image" if t < 0 else t for t in ids] == layout
    qwen25 = enc.config.projector == QWEN25VL
    as_llama_cpp = qwen_as_llama_cpp_runs_it if qwen25 else model
    if qwen25:
        _, ids = read_prompt(as_llama_cpp, enc, case)
    logits, greedy = greedy_after(as_llama_cpp, ids, len(case["greedy_ids"]))
    assert np.abs(logits - NPZ[f"{key}/last_logits"]).max() < 1e-6
    assert greedy == case["greedy_ids"]
    if qwen25:
        _, ids = read_prompt(model, enc, case)
        assert greedy_after(model, ids, len(case["greedy_ids"]))[1] == case["greedy_ids"]


QWEN = sorted(k for k in CASES if k.startswith("tiny-qwen25vl/"))


@pytest.fixture(scope="module")
def qwen_as_llama_cpp_runs_it(tmp_path_factory):
    """tiny-qwen25vl with the RMS norms' epsilon llama.cpp 0.3.36 uses for `qwen2vl`: 0 — its
    qwen2vl loader reads the rope sections and not the file's epsilon (the qwen2 loader's read was
    left behind a "fall through" comment when the loaders were split per model)."""
    path = copy_gguf(VISION / "tiny-qwen25vl.gguf", tmp_path_factory.mktemp("qwen") / "eps0.gguf",
                     meta={"qwen2vl.attention.layer_norm_rms_epsilon": 0.0})
    return load_model(path)


@pytest.mark.parametrize("key", QWEN)
def test_qwen25vl_text_after_mtmds_rows_is_llama_cpps_bits(loaded, qwen_as_llama_cpp_runs_it, key):
    """The text side alone — mtmd's own image rows placed by M-RoPE (time, height, width; the image
    takes max(across, down) positions) — gives llama.cpp's logits bit for bit (with the epsilon it
    runs); with one position a row (the plain rope) they are far off."""
    model, (_, enc) = qwen_as_llama_cpp_runs_it, loaded["tiny-qwen25vl"]
    case = CASES[key]
    _, ids = read_prompt(model, enc, case, [NPZ[f"{key}/image0"]])
    want = NPZ[f"{key}/last_logits"]
    assert np.array_equal(model.forward(ids, model.new_cache(256)), want)
    model.mrope = False
    try:
        assert np.abs(model.forward(ids, model.new_cache(256)) - want).max() > 0.5
    finally:
        model.mrope = True


def test_qwen25vl_positions_carry_across_forwards_and_rollbacks(loaded):
    """A prompt fed in parts that end inside the image, a cache rolled back into the image and fed
    again, and a copied cache all give the one forward's logits (the positions' memo is the
    cache's); a context shift is refused (llama.cpp refuses it on M-RoPE models too)."""
    model, enc = loaded["tiny-qwen25vl"]
    _, ids = read_prompt(model, enc, CASES["tiny-qwen25vl/large"])
    whole = model.forward(ids, model.new_cache(256))
    cache = model.new_cache(256)
    for a, b in ((0, 3), (3, 40), (40, 90), (90, len(ids))):
        logits = model.forward(ids[a:b], cache)
    assert np.array_equal(logits, whole)
    cache.truncate(20)
    assert np.array_equal(model.forward(ids[20:], cache), whole)
    twin = model.new_cache(256)
    twin.copy_from(cache)
    assert np.array_equal(model.forward([5], twin), model.forward([5], cache))
    assert not model.can_shift_over(cache.tokens)
    with pytest.raises(ValueError, match="cannot shift on this model: M-RoPE"):
        model.shift_cache(cache, 4, 10)


@pytest.mark.parametrize("key", ["tiny-qwen25vl/large", "tiny-qwen3vl/large", "tiny-gemma3v/wide", "tiny-smolvlm/wide"])
def test_the_numpy_path_meets_the_bars(loaded, key):
    """Without the compiled kernels: the image's rows correlate ≥ 0.999 with mtmd's and the greedy
    text after them is llama.cpp's."""
    from kiln.native import kernels
    case = CASES[key]
    model, enc = loaded[case["model"][:-5]]
    previous = kernels.use_compiled(False)
    try:
        data = (VISION / case["image"]).read_bytes()
        rows = enc.encode_image(enc.read(data))
        for i, r in enumerate(rows):
            assert cosine(r, NPZ[f"{key}/image{i}"]) >= 0.999
        _, ids = read_prompt(model, enc, case, [NPZ[f"{key}/image{i}"] for i in range(len(rows))])
        assert greedy_after(model, ids, len(case["greedy_ids"]))[1] == case["greedy_ids"]
    finally:
        kernels.use_compiled(previous)


def test_qwen3vl_deepstack_slices_reach_the_first_layers(loaded):
    """Qwen3-VL's rows carry a slice per deepstack layer (the text model adds them after its first
    layers): zeroed, the logits after the image are far from llama.cpp's; rows of another width are
    refused naming why."""
    model, enc = loaded["tiny-qwen3vl"]
    case = CASES["tiny-qwen3vl/large"]
    rows = NPZ["tiny-qwen3vl/large/image0"].copy()
    assert rows.shape[1] == 3 * model.config.n_embd and enc.config.deepstack == (1, 2)
    rows[:, model.config.n_embd:] = 0
    _, ids = read_prompt(model, enc, case, [rows])
    assert np.abs(model.forward(ids, model.new_cache(256)) - NPZ["tiny-qwen3vl/large/last_logits"]).max() > 0.1
    narrow = model.media.add(image_key("narrow", b"", 0), rows[:, :2 * model.config.n_embd], grid=(9, 6))
    with pytest.raises(ValueError, match="image rows of 256 values .* made for another model"):
        model.forward([1, *narrow], model.new_cache(256))


def test_gemma3_image_rows_attend_both_ways(loaded):
    """Causally, the first image row would not see the last: the logits after it would differ."""
    model, enc = loaded["tiny-gemma3v"]
    case = CASES["tiny-gemma3v/cat"]
    data = (VISION / case["image"]).read_bytes()
    rows = enc.encode_image(enc.read(data))
    causal = model.media.add(image_key("causal", data, 0), rows[0], bidirectional=False)
    it = ImageTokens(model.tokenizer, "gemma3")
    ids = prompt_ids(model.tokenizer, case["prompt"], [it.around([causal], (0, 0))])
    logits = model.forward(ids, model.new_cache(256))
    assert np.abs(logits - NPZ["tiny-gemma3v/cat/last_logits"]).max() > 1e-2


def test_image_prompt_split_across_forwards_matches_one(loaded):
    """The prompt cache and chunked prefill feed a prompt in parts: a part boundary outside the
    image gives the same logits as one forward."""
    model, enc = loaded["tiny-smolvlm"]
    case = CASES["tiny-smolvlm/wide"]
    _, ids = read_prompt(model, enc, case)
    cache = model.new_cache(256)
    model.forward(ids[:5], cache)
    logits = model.forward(ids[5:], cache)
    assert np.abs(logits - NPZ["tiny-smolvlm/wide/last_logits"]).max() < 1e-3


def test_a_row_no_longer_held_is_refused(loaded):
    model, _ = loaded["tiny-smolvlm"]
    with pytest.raises(ValueError, match="image row .* not held"):
        model.forward([1, -12345], model.new_cache(16))


def test_markers_and_images_must_pair(loaded):
    model, _ = loaded["tiny-smolvlm"]
    with pytest.raises(ValueError, match="2 image markers for 1 images"):
        prompt_ids(model.tokenizer, f"a{MARKER}b{MARKER}", [[1]])


def test_mmproj_of_another_model_is_refused(loaded):
    model, _ = loaded["tiny-smolvlm"]
    with pytest.raises(ValueError, match="no '<start_of_image>' token.*does not belong"):
        ImageTokens(model.tokenizer, "gemma3")


def png_header(w: int, h: int) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"GIF89a not really", "not an image|corrupt"),
    (b"%PDF-1.7\n" + b"x" * 100, "not an image"),
    (png_header(10000, 6000), "60000000 pixels|10000×6000 pixels is over the 50 megapixel limit"),
    ((VISION / "cat.png").read_bytes()[:200], "corrupt"),
])
def test_hostile_images_are_refused_naming_the_problem(data, message):
    with pytest.raises(ImageError, match=message):
        decode(data, "messages[0].content[1]")


def thin_png(w: int, h: int) -> bytes:
    import io
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("proj", ["qwen25vl", "qwen3vl"])
def test_a_thin_image_that_would_outgrow_a_qwen_encoder_is_refused(proj):
    """Resized with each side kept at one block at least, a 400,000×1 image would have become
    ~14,000 rows wide (its attention quadratic in them): refused naming the field."""
    enc = load_vision(VISION / f"mmproj-tiny-{proj}.gguf")
    with pytest.raises(ImageError, match=r"^images\[0\]: 400000×1 pixels is too long and thin"):
        enc.read(thin_png(400_000, 1), "images[0]")
    assert enc.read(thin_png(2_000, 10), "images[0]").grid[1] == 1       # long but within the rows


def test_image_error_names_the_field():
    with pytest.raises(ImageError, match=r"^images\[2\]: "):
        decode(b"nope", "images[2]")


@pytest.mark.parametrize("change, message", [
    (dict(meta={"clip.projector_type": "qwen2vl"}), "projector type 'qwen2vl' is not one Kiln runs"),
    (dict(meta={"clip.vision.block_count": 7}), "block_count = 7: the file holds 2 vision layers"),
    (dict(meta={"clip.vision.attention.head_count": 5}), "head_count = 5: must divide embedding_length"),
    (dict(meta={"clip.vision.patch_size": 5}), "patch_size = 5: must divide image_size"),
    (dict(meta={"clip.vision.image_std": [0.5, 0.0, 0.5]}), "image_std.*positive"),
    (dict(drop=["v.blk.1.attn_k.weight"]), "v.blk.1.attn_k.weight"),
    (dict(drop=["mm.model.fc.weight"]), "mm.model.fc.weight"),
])
def test_hostile_mmproj_is_refused_naming_what(tmp_path, change, message):
    bad = copy_gguf(VISION / "mmproj-tiny-smolvlm.gguf", tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message):
        load_vision(bad)


@pytest.mark.parametrize("change, message", [
    (dict(meta={"clip.use_silu": False}), "use_silu = False: a Qwen2.5-VL vision tower's FFN is SwiGLU"),
    (dict(meta={"clip.vision.spatial_merge_size": 3}), "spatial_merge_size = 3: Qwen2.5-VL's merger joins 2×2"),
    (dict(meta={"clip.vision.attention.head_count": 32}), "head_count = 32: a head's width, 2, must split in 4"),
    (dict(meta={"clip.vision.n_wa_pattern": 100000}), "n_wa_pattern = 100000: must be in 0..4096"),
    (dict(drop_keys=["clip.vision.n_wa_pattern"]), "clip.vision.n_wa_pattern' is missing"),
    (dict(drop=["v.patch_embd.weight.1"]), "v.patch_embd.weight.1"),
    (dict(drop=["v.blk.2.attn_q.bias"]), "v.blk.2.attn_q.bias"),
    (dict(drop=["mm.2.bias"]), "mm.2.bias"),
])
def test_hostile_qwen25vl_mmproj_is_refused_naming_what(tmp_path, change, message):
    bad = copy_gguf(VISION / "mmproj-tiny-qwen25vl.gguf", tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message):
        load_vision(bad)


@pytest.mark.parametrize("sections, message", [
    (None, "qwen2vl.rope.dimension_sections' is missing"),
    ([4, 6, 6], "must be 4 section sizes"),
    ([8, 8, 8, 0], "must cover 1..16 of the rotated pairs"),
])
def test_qwen2vl_text_model_needs_its_rope_sections(tmp_path, sections, message):
    change = dict(drop_keys=["qwen2vl.rope.dimension_sections"]) if sections is None else \
        dict(meta={"qwen2vl.rope.dimension_sections": sections})
    bad = copy_gguf(VISION / "tiny-qwen25vl.gguf", tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message):
        load_model(bad)


@pytest.mark.parametrize("change, message", [
    (dict(meta={"clip.use_gelu": False}), "use_gelu = False: a Qwen3-VL vision tower's FFN is GELU"),
    (dict(drop=["v.position_embd.weight"], add={"v.position_embd.weight": np.zeros((15, 64), np.float32)}),
     "has 15 positions: a Qwen3-VL table is a square"),
    (dict(drop=["v.patch_embd.bias"]), "v.patch_embd.bias"),
    (dict(drop=["v.deepstack.2.fc2.bias"]), "v.deepstack.2.fc2.bias"),
    (dict(drop=["v.blk.0.attn_qkv.weight"]), "v.blk.0.attn_qkv.weight"),
])
def test_hostile_qwen3vl_mmproj_is_refused_naming_what(tmp_path, change, message):
    bad = copy_gguf(VISION / "mmproj-tiny-qwen3vl.gguf", tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message):
        load_vision(bad)


def test_a_text_model_is_not_an_mmproj():
    with pytest.raises(GGUFError, match="not an mmproj"):
        load_vision(VISION / "tiny-smolvlm.gguf")


def test_plan_and_capabilities_count_the_projector_beside_the_model():
    from kiln.native.models.hub_refs import mmprojs_beside
    from kiln.native.models.inspect import inspect_model
    from kiln.native.models.plan import plan
    # two models' projectors in one folder: each model takes the one whose name is nearest its own
    assert mmprojs_beside(VISION / "tiny-gemma3v.gguf")[0].name == "mmproj-tiny-gemma3.gguf"
    assert mmprojs_beside(VISION / "tiny-smolvlm.gguf")[0].name == "mmproj-tiny-smolvlm.gguf"
    # the plan pairs each Qwen text model with its own projector, not another of the same width
    for name in ("qwen25vl", "qwen3vl"):
        assert plan(VISION / f"tiny-{name}.gguf")["mmproj"].endswith(f"mmproj-tiny-{name}.gguf")
    with_vision, without = plan(VISION / "tiny-smolvlm.gguf"), plan(VISION / "tiny-smolvlm.gguf", mmproj="off")
    assert with_vision["mmproj"].endswith("mmproj-tiny-smolvlm.gguf") and with_vision["vision_bytes"] > 200_000
    assert with_vision["total_bytes"] - without["total_bytes"] == with_vision["vision_bytes"] and "mmproj" not in without
    assert "vision" in inspect_model(VISION / "tiny-smolvlm.gguf")["capabilities"]
    assert "vision" not in inspect_model(DATA / "tiny" / "tiny-llama.gguf")["capabilities"]


def test_held_rows_are_found_and_evicted_rows_refused():
    """An image seen lately is not encoded again (its ids come back); rows pushed out by newer
    ones are refused by the forward, naming the row, never read as another image's."""
    from kiln.native.vision.layout import MediaRows
    media = MediaRows(budget=4096)
    first = media.add(1, np.ones((4, 128), np.float32))
    assert media.ids_if_held(1) == first and media.ids_if_held(2) is None
    media.add(2, np.zeros((6, 128), np.float32))               # 4 KiB: the first is dropped
    assert media.ids_if_held(1) is None and first[0] not in media
    with pytest.raises(KeyError, match="no longer held"):
        media.rows(np.array(first))
