"""`kiln models quantize`: the bytes llama.cpp's quantizer writes, for every file type Kiln offers,
on three tiny models (a tied llama in F16, an eight-expert qwen3moe in F32 whose rows fall back from
K-quants, an untied qwen3 in BF16) — against llama.cpp's hashes recorded by
tests/tools/make_quantize_reference.py, and against llama.cpp live where llama-cpp-python is
installed; a split input gives the unsplit file's bytes; what cannot be quantized is refused before
a byte is written, and nothing is left behind."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from quant_models import INPUTS, llama_cpp_quantize, write_dense

from kiln.native import kernels
from kiln.native.models.quant_types import FILE_TYPES, QuantizeError
from kiln.native.models.quantize import quantize_model

pytestmark = pytest.mark.skipif(kernels.compiled_module() is None, reason="the compiled extension is not built")
REF = json.loads((Path(__file__).parent / "data" / "quantize.json").read_text())


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant-inputs")
    return {name: make(d / f"{name}.gguf") for name, make in INPUTS.items()}


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
@pytest.mark.parametrize("model", list(INPUTS))
def test_the_file_is_llama_cpps_bytes(inputs, model, ftype, tmp_path):
    src = inputs[model]
    if sha(src) != REF["inputs"][model]:
        pytest.skip(f"this machine's numpy/gguf wrote another {model} than the reference's (compared live below)")
    out = tmp_path / "kiln.gguf"
    r = quantize_model(src, out, ftype)
    assert sha(out) == REF["outputs"][f"{model}.{ftype}"] == r["sha256"], (model, ftype, r["types"])
    assert [p.name for p in tmp_path.iterdir()] == ["kiln.gguf", "kiln.gguf.kiln-manifest.json"]


@pytest.mark.parametrize("model", ["qwen3moe-f32-e8"])
def test_llama_cpp_live_writes_the_same_bytes(inputs, model, tmp_path):
    """Where llama-cpp-python is installed, its quantizer now, on the model with the most rules
    (eight experts, fallbacks, an untied head): the recorded hashes above cover the rest."""
    pytest.importorskip("llama_cpp")
    for ftype in ("Q4_K_M", "Q6_K"):
        ours, theirs = tmp_path / f"{ftype}.kiln.gguf", tmp_path / f"{ftype}.llama.gguf"
        quantize_model(inputs[model], ours, ftype, threads=1)
        llama_cpp_quantize(inputs[model], theirs, ftype)
        assert ours.read_bytes() == theirs.read_bytes(), (model, ftype)


def test_a_split_input_gives_the_unsplit_files_bytes(inputs, tmp_path):
    from split_gguf import split
    parts = split(inputs["llama-f16-tied"], tmp_path, 3)
    whole = quantize_model(inputs["llama-f16-tied"], tmp_path / "whole.gguf", "Q4_K_M")
    joined = quantize_model(parts[0], tmp_path / "joined.gguf", "Q4_K_M")
    assert whole["sha256"] == joined["sha256"] == sha(tmp_path / "joined.gguf")


def test_the_mixture_is_llama_cpps(inputs, tmp_path):
    """What the names promise: Q6_K for the head and for the value and down projections of the
    first and last eighth of the layers and every third between; eight experts get Q8_0 keys and
    values; 320-wide rows fall back (Q4_K -> Q5_0)."""
    from kiln.native.gguf_file import read_gguf
    quantize_model(inputs["llama-f16-tied"], tmp_path / "a.gguf", "Q4_K_M")
    t = {n: i.type.name for n, i in read_gguf(tmp_path / "a.gguf").tensors.items()}
    assert t["token_embd.weight"] == "Q6_K"                                  # tied: the head's type
    more = [i for i in range(10) if t[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert more == [i for i in range(10) if t[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == [0, 3, 6, 8, 9]
    assert {t[f"blk.{i}.attn_q.weight"] for i in range(10)} == {"Q4_K"} and t["output_norm.weight"] == "F32"
    r = quantize_model(inputs["qwen3moe-f32-e8"], tmp_path / "b.gguf", "Q4_K_M")
    t = {n: i.type.name for n, i in read_gguf(tmp_path / "b.gguf").tensors.items()}
    assert t["blk.0.attn_k.weight"] == t["blk.0.attn_v.weight"] == "Q8_0" and t["output.weight"] == "Q8_0"
    assert t["blk.0.ffn_gate_inp.weight"] == "F32" and t["blk.1.ffn_up_exps.weight"] == "Q5_0"
    assert {"tensor": "blk.1.ffn_up_exps.weight", "wanted": "Q4_K", "used": "Q5_0"} in r["fallbacks"]


def test_what_cannot_be_quantized_is_refused_before_a_byte_is_written(inputs, tmp_path):
    q8 = tmp_path / "q8.gguf"
    quantize_model(inputs["llama-f16-tied"], q8, "Q8_0")
    nan = write_dense(tmp_path / "nan.gguf", "F32", n_layer=2)
    raw = bytearray(nan.read_bytes())
    from kiln.native.gguf_file import read_gguf
    info = read_gguf(nan).tensors["blk.1.ffn_up.weight"]
    raw[info.offset + 400: info.offset + 404] = np.float32(np.nan).tobytes()
    nan.write_bytes(bytes(raw))
    out = tmp_path / "out"
    out.mkdir()
    for src, ftype, words in ((q8, "Q4_K_M", "is Q8_0 already"), (inputs["llama-f16-tied"], "Q3_K_M", "not one Kiln writes"),
                              (nan, "Q4_0", "'blk.1.ffn_up.weight' holds NaN"), (tmp_path / "none.gguf", "Q4_0", "no such file"),
                              (inputs["llama-f16-tied"], "Q4_0", "exists already")):
        dst = out / ("exists.gguf" if words == "exists already" else "x.gguf")
        if words == "exists already":
            dst.write_bytes(b"keep me")
        with pytest.raises(QuantizeError, match=words):
            quantize_model(src, dst, ftype)
        assert sorted(p.name for p in out.iterdir()) == (["exists.gguf"] if words == "exists already" else [])
    assert (out / "exists.gguf").read_bytes() == b"keep me"


def test_the_cli_quantizes_into_the_library_and_verify_checks_it(inputs, tmp_path):
    env = {"KILN_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "KILN_VERBOSITY": "0"}
    run = [sys.executable, "-m", "kiln.supervisor.cli"]
    r = subprocess.run(run + ["models", "quantize", str(inputs["llama-f16-tied"]), "tiny", "q4_k_m", "--json"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["output"] == str(tmp_path / "home" / "models" / "tiny.gguf")
    assert out["sha256"] == REF["outputs"]["llama-f16-tied.Q4_K_M"] or sha(inputs["llama-f16-tied"]) != \
        REF["inputs"]["llama-f16-tied"]
    assert "100%" in r.stderr
    v = subprocess.run(run + ["models", "verify", "tiny"], capture_output=True, text=True, env=env, timeout=60)
    assert v.returncode == 0 and v.stdout.startswith("ok") and "quantize:llama-f16-tied.gguf:Q4_K_M" in v.stdout
    again = subprocess.run(run + ["models", "quantize", str(inputs["llama-f16-tied"]), "tiny", "Q4_0"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 1 and "exists already" in again.stderr and "--force" in again.stderr
