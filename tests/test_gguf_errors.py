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


def test_missing_tensor_is_named(tmp_path):
    g = read_gguf(tiny_path("llama"))
    p = tmp_path / "missing.gguf"
    w = GGUFWriter(p, "llama")
    import gguf
    r = gguf.GGUFReader(tiny_path("llama"))
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for t in r.tensors:
        if t.name != "blk.1.ffn_up.weight":
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
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
