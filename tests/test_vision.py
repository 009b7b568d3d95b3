"""Vision against llama.cpp's own mtmd (tests/tools/make_tiny_vision.py made the references with
llama-cpp-python's libmtmd): each image's embeddings for a Gemma 3 and an Idefics3 (SmolVLM)
projector, the prompt's layout of image rows between the model's image tokens, the logits after
the image and the greedy continuation — Gemma 3's image rows attending to each other both ways;
hostile images and mmproj files refused naming what is wrong."""

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
    for name in ("tiny-smolvlm", "tiny-gemma3v"):
        proj = "smolvlm" if name == "tiny-smolvlm" else "gemma3"
        out[name] = (load_model(VISION / f"{name}.gguf"), load_vision(VISION / f"mmproj-tiny-{proj}.gguf"))
    return out


def read_prompt(model, enc, case):
    data = (VISION / case["image"]).read_bytes()
    tiles = enc.read(data)
    rows = enc.encode_image(tiles)
    squares = [model.media.add(image_key(enc.digest, data, i), r, enc.config.projector == "gemma3")
               for i, r in enumerate(rows)]
    ids = prompt_ids(model.tokenizer, case["prompt"], [ImageTokens(model.tokenizer, enc.config.projector)
                                                       .around(squares, tiles.grid)])
    return rows, ids


@pytest.mark.parametrize("key", sorted(CASES))
def test_image_embeddings_and_text_after_match_mtmd(loaded, key):
    case = CASES[key]
    model, enc = loaded[case["model"][:-5]]
    rows, ids = read_prompt(model, enc, case)
    assert len(rows) == sum("image" in c for c in case["chunks"])
    for i, r in enumerate(rows):
        want = NPZ[f"{key}/image{i}"]
        assert r.shape == want.shape
        assert cosine(r, want) >= 0.999 and np.abs(r - want).max() < 1e-3, (i, np.abs(r - want).max())
    layout = [t for c in case["chunks"] for t in (c["text"] if "text" in c else ["image"] * c["image"])]
    assert ["image" if t < 0 else t for t in ids] == layout
    cache = model.new_cache(256)
    logits = model.forward(ids, cache)
    assert np.abs(logits - NPZ[f"{key}/last_logits"]).max() < 1e-3
    greedy = []
    for _ in case["greedy_ids"]:
        greedy.append(int(np.argmax(logits)))
        logits = model.forward([greedy[-1]], cache)
    assert greedy == case["greedy_ids"]


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
