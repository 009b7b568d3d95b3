"""Every bad model file gets an error that names the file and the problem."""

import shutil

import numpy as np
import pytest
from gguf import GGUFWriter

from conftest import tiny_path
from kiln.native.gguf_file import GGUFError, read_gguf
from kiln.native.model import load_model


def test_missing_file_is_named(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        read_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"this is a text file, not a model" * 4)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(p)


@pytest.mark.parametrize("keep", [30, 5000, 200_000])
def test_truncated_file_says_truncated(tmp_path, keep):
    src = tiny_path("llama").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(src[:keep])
    with pytest.raises(GGUFError, match="truncated"):
        load_model(p)


def test_directory_is_refused(tmp_path):
    with pytest.raises(GGUFError, match="directory"):
        read_gguf(tmp_path)


def _write(path, arch, tensors: dict[str, np.ndarray], extra=None):
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(1)
    w.add_context_length(64)
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_lists_supported(tmp_path):
    p = tmp_path / "bert.gguf"
    _write(p, "bert", {"token_embd.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(GGUFError, match=r"architecture 'bert' is not supported \(supported: llama"):
        load_model(p)


def _rewrite(src, dst, meta=None, drop=()):
    """A copy of the GGUF `src` with metadata values replaced (key -> (value, type, element type))
    and the tensors `drop` left out."""
    import gguf
    r = gguf.GGUFReader(src)
    w = GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, *(meta or {}).get(key, (field.contents(), field.types[0], sub)))
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


def test_missing_tensor_is_named(tmp_path):
    g = read_gguf(tiny_path("llama"))
    p = _rewrite(tiny_path("llama"), tmp_path / "missing.gguf", drop={"blk.1.ffn_up.weight"})
    assert "blk.1.ffn_up.weight" in g.tensors
    with pytest.raises(GGUFError, match="'blk.1.ffn_up.weight' is missing"):
        load_model(p)


def test_tensor_type_that_does_not_fit_its_shape_is_named(tmp_path):
    src = tiny_path("llama")
    p = tmp_path / "i32.gguf"
    shutil.copy(src, p)
    g = read_gguf(src)
    info = g.tensors["blk.0.attn_q.weight"]
    # rewrite that tensor's type id in the header (Q8_0=8 -> I32=26, same row bytes don't matter)
    raw = bytearray(p.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at:type_at + 4], "little") == info.type.value
    raw[type_at:type_at + 4] = (29).to_bytes(4, "little")     # IQ1_M: block 256 > row 128
    p.write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match="blk.0.attn_q.weight"):
        load_model(p)


def test_header_only_read_skips_vocabulary():
    g = read_gguf(tiny_path("llama"), skip_arrays=True)
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 288
    assert g.architecture == "llama"
    assert g.tensors.keys() == read_gguf(tiny_path("llama")).tensors.keys()


@pytest.mark.parametrize("keep", [2000, 3000, 5000])     # inside the vocabulary's strings
def test_a_header_read_over_a_cut_vocabulary_says_truncated(tmp_path, keep):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_path("llama").read_bytes()[:keep])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf(p, skip_arrays=True)


# -- hostile headers (tests/test_gguf_fuzz.py runs hundreds; these name what each check says) -----

def _patched(tmp_path, old: bytes, new: bytes, src=None):
    data = (src or tiny_path("llama")).read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    p = tmp_path / "patched.gguf"
    p.write_bytes(data.replace(old, new))
    return p


def _tensor_field(name: bytes, field: str) -> tuple[int, int]:
    """(offset, size) of a tensor's n_dims, dim0, dim1, type or offset field in tiny-llama's header."""
    data = tiny_path("llama").read_bytes()
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    return {"n_dims": (at, 4), "dim0": (at + 4, 8), "dim1": (at + 12, 8), "type": (at + 4 + 8 * n_dims, 4),
            "offset": (at + 8 + 8 * n_dims, 8)}[field]


def _with_field(tmp_path, name: bytes, field: str, value: int):
    data = bytearray(tiny_path("llama").read_bytes())
    at, size = _tensor_field(name, field)
    data[at:at + size] = value.to_bytes(size, "little")
    p = tmp_path / "field.gguf"
    p.write_bytes(bytes(data))
    return p


@pytest.mark.parametrize("field,value,says", [
    ("n_dims", 5, r"5 dimensions \(a tensor has 1 to 4\)"),
    ("dim1", 0, r"include 0 \(each must be at least 1\)"),
    ("dim1", 2**63 - 1, r"end past the file"),
    ("type", 99, r"unknown tensor type id 99"),
    ("offset", 8, r"data offset 8 is not a multiple of the alignment 32"),
    ("offset", 2**40, r"end past the file"),
])
def test_a_bad_tensor_entry_names_the_tensor_and_the_byte(tmp_path, field, value, says):
    p = _with_field(tmp_path, b"blk.0.attn_q.weight", field, value)
    with pytest.raises(GGUFError, match=rf"tensor 'blk.0.attn_q.weight' \(byte \d+\): .*{says}"):
        read_gguf(p)


def test_a_tensor_name_longer_than_ggml_allows_is_refused_before_it_is_read(tmp_path):
    """A garbage length must not decode megabytes of tensor data into a name (and an error message)."""
    data = bytearray(tiny_path("llama").read_bytes())
    at = data.index(b"blk.0.attn_q.weight") - 8
    data[at:at + 8] = (300_000).to_bytes(8, "little")
    p = tmp_path / "name.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=rf"tensor #\d+ \(byte {at}\): a name of 300,000 bytes \(at most 63\)"):
        read_gguf(p)


def test_a_duplicate_tensor_name_is_refused(tmp_path):
    p = _patched(tmp_path, b"blk.0.attn_v.weight", b"blk.0.attn_k.weight")
    with pytest.raises(GGUFError, match="'blk.0.attn_k.weight' .*a second tensor of this name"):
        read_gguf(p)


def test_counts_beyond_the_file_are_refused_before_reading(tmp_path):
    data = bytearray(tiny_path("llama").read_bytes())
    data[16:24] = (2**40).to_bytes(8, "little")                   # metadata key count
    p = tmp_path / "kv.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"metadata key count \(byte 16\): the metadata keys .* run past the end"):
        read_gguf(p)


def test_a_tensor_of_the_wrong_shape_is_found_at_load(tmp_path):
    p = _with_field(tmp_path, b"blk.0.attn_q.weight", "dim1", 64)       # 64 rows, not 4 heads x 32
    with pytest.raises(GGUFError, match=r"'blk.0.attn_q.weight' has shape \[64, 128\], expected \[128, 128\]"):
        load_model(p)


def _meta(tmp_path, **changes):
    import gguf
    T = gguf.GGUFValueType
    kinds = {"u32": (T.UINT32, None), "i32s": (T.ARRAY, T.INT32), "strs": (T.ARRAY, T.STRING)}
    meta = {k.replace("__", "."): (v, *kinds[kind]) for k, (v, kind) in changes.items()}
    return _rewrite(tiny_path("llama"), tmp_path / "meta.gguf", meta)


@pytest.mark.parametrize("changes,says", [
    ({"llama__attention__head_count": (0, "u32")}, r"llama.attention.head_count = 0: must be in 1\.\."),
    ({"llama__attention__head_count_kv": (3, "u32")}, r"head_count_kv = 3: must divide head_count, 4"),
    ({"llama__block_count": (3, "u32")}, r"llama.block_count = 3: the file holds layers 0..1 \(2 of them\)"),
    ({"llama__context_length": (2**32 - 1, "u32")}, r"llama.context_length = 4294967295: must be in 1\.\."),
    ({"tokenizer__ggml__token_type": ([1] * 287, "i32s")}, r"'tokenizer.ggml.token_type': must be an array of 288"),
    ({"tokenizer__ggml__bos_token_id": (288, "u32")}, r"'tokenizer.ggml.bos_token_id': 288 is not a token id"),
    ({"tokenizer__ggml__merges": (["zz qq"], "strs")}, r"'tokenizer.ggml.merges': the tokenizer cannot be built"),
])
def test_a_bad_hyperparameter_or_vocabulary_is_named_at_load(tmp_path, changes, says):
    with pytest.raises(GGUFError, match=says):
        load_model(_meta(tmp_path, **changes))


@pytest.mark.parametrize(("lie", "says"), [
    ({1: {"no": 2}}, "expected part 1 of 3"),                 # a part that claims another place
    ({2: {"count": 4}}, "expected part 2 of 3"),              # a part of another set
    ({0: {"total": 99}}, "split.tensors.count says 99"),      # fewer tensors than promised
    ({0: {"count": 0}}, "is not a part of a split model"),
    ({0: {"no": 1}}, "open the first part"),
])
def test_a_split_model_whose_parts_disagree_is_refused_naming_the_part(tmp_path, lie, says):
    from split_gguf import split
    first = split(tiny_path("llama"), tmp_path, 3, lie)[0]
    with pytest.raises(GGUFError, match=says):
        read_gguf(first)


def test_a_split_model_loads_as_the_whole_file(tmp_path):
    from split_gguf import split
    parts = split(tiny_path("llama"), tmp_path, 3)
    whole, g = read_gguf(tiny_path("llama")), read_gguf(parts[0])
    assert g.parts == tuple(parts) and set(g.tensors) == set(whole.tensors) and {t.part for t in g.tensors.values()} == {0, 1, 2}
    for name in whole.tensors:
        assert np.array_equal(g.raw(name), whole.raw(name)), name
    with pytest.raises(GGUFError, match="part 2 of 3 of a split model: open the first part"):
        read_gguf(parts[1])
    renamed = parts[0].with_name("renamed.gguf")
    parts[0].rename(renamed)
    with pytest.raises(GGUFError, match="must be named NAME-00001-of-00003.gguf"):
        read_gguf(renamed)
