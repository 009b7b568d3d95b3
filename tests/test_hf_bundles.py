"""HF/TRL bundles (issue 42 item 3), fast tier: `kiln train hf export-sft` writes canonical JSONL, a
trainer script and a manifest of every byte; `verify` names the file and field a changed byte
breaks; the dataset loads with Hugging Face `datasets` as the script loads it; the adapter a
bundle comes back with is imported only when it matches its own manifest, and an archive with a
link, an absolute or `..` path is refused before anything is written."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import tarfile

import pytest
from typer.testing import CliRunner

from kiln.protocol.store.hf_bundles import BundleError, unpack, verify
from kiln.supervisor.cli.main import app

CONVS = [{"messages": [{"role": "user", "content": "What is Kiln?"}, {"role": "assistant", "content": "A runtime."}]},
         {"messages": [{"content": "hi", "role": "user"}, {"role": "assistant", "content": "hello ünïcode"}]}]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(*args):
    return CliRunner().invoke(app, list(args))


def export(tmp_path, name="b1", rows=CONVS):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run("train", "hf", "export-sft", "-f", str(data), "--name", name, "--rank", "8")


def test_export_writes_canonical_data_a_script_and_a_manifest_that_verifies(home, tmp_path):
    r = export(tmp_path)
    assert r.exit_code == 0, r.output
    folder = home / "hf" / "b1"
    lines = (folder / "dataset.jsonl").read_bytes().splitlines()
    assert lines[1] == '{"messages":[{"content":"hi","role":"user"},{"content":"hello ünïcode","role":"assistant"}]}'.encode()
    m = verify(folder)
    assert m["hf_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and m["options"]["rank"] == 8 and m["rows"] == 2
    assert m["files"]["dataset.jsonl"]["sha256"] == hashlib.sha256((folder / "dataset.jsonl").read_bytes()).hexdigest()
    ast.parse((folder / "train_trl.py").read_text())
    assert run("train", "hf", "verify", "b1").exit_code == 0
    assert "b1" in run("train", "hf", "list").output
    assert export(tmp_path).exit_code != 0                               # a name is not overwritten


def test_the_dataset_loads_with_hugging_face_datasets_as_the_script_loads_it(home, tmp_path):
    datasets = pytest.importorskip("datasets") if os.environ.get("CI") != "true" else __import__("datasets")
    assert export(tmp_path).exit_code == 0
    ds = datasets.load_dataset("json", data_files=str(home / "hf" / "b1" / "dataset.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert len(ds) == 2 and ds[1]["messages"][1] == {"content": "hello ünïcode", "role": "assistant"}


def test_bad_lines_are_named_and_nothing_is_written(home, tmp_path):
    r = export(tmp_path, rows=[CONVS[0], {"messages": [{"role": "user", "content": "no answer"}]}])
    assert r.exit_code != 0 and "line 2: no assistant turn" in r.output
    assert not (home / "hf" / "b1").exists()


@pytest.mark.parametrize("change, field", [("byte", "files.dataset.jsonl.sha256"), ("append", "files.dataset.jsonl.bytes"),
                                           ("link", "files.dataset.jsonl: not a regular file")])
def test_verify_names_the_file_and_field_a_change_breaks(home, tmp_path, change, field):
    assert export(tmp_path).exit_code == 0
    p = home / "hf" / "b1" / "dataset.jsonl"
    data = bytearray(p.read_bytes())
    if change == "byte":
        data[10] ^= 1
        p.write_bytes(bytes(data))
    elif change == "append":
        p.write_bytes(bytes(data) + b"\n")
    else:
        (tmp_path / "elsewhere").write_bytes(bytes(data))
        p.unlink()
        p.symlink_to(tmp_path / "elsewhere")
    r = run("train", "hf", "verify", "b1")
    assert r.exit_code != 0 and field in r.output


def _came_back(folder, default_model):
    """What train_trl.py leaves: adapter/ with a PEFT adapter and its manifest."""
    from kiln.native.training.peft import export_peft
    from test_lora_interop import interop_adapter
    c = default_model.config
    out = export_peft(interop_adapter(default_model), folder / "adapter", c.n_head, c.n_head_kv, "SmolLM2")
    files = {n: {"bytes": (out / n).stat().st_size, "sha256": hashlib.sha256((out / n).read_bytes()).hexdigest()}
             for n in ("adapter_config.json", "adapter_model.safetensors")}
    (out / "manifest.json").write_text(json.dumps({"format": "kiln-hf-bundle/1", "files": files}))
    return out


def test_the_adapter_that_comes_back_is_imported_only_when_it_matches(home, tmp_path, default_model, default_model_path,
                                                                       monkeypatch):
    monkeypatch.setenv("KILN_MODEL_PATH", str(default_model_path.parent))
    assert export(tmp_path).exit_code == 0
    out = _came_back(home / "hf" / "b1", default_model)
    weights = out / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    r = run("train", "hf", "import-peft", "--bundle", "b1", "--name", "back")
    assert r.exit_code != 0 and "files.adapter_model.safetensors.sha256" in r.output
    weights.write_bytes(good)
    r = run("train", "hf", "import-peft", "--bundle", "b1", "--name", "back", "--model", str(default_model_path))
    assert r.exit_code == 0, r.output
    from kiln.protocol.store.adapter_registry import AdapterRegistry
    assert "back" in AdapterRegistry(home).names()
    assert "trained" in run("train", "hf", "list").output
    assert run("train", "hf", "delete", "b1").exit_code == 0 and not (home / "hf" / "b1").exists()


def _tar(path, members):
    with tarfile.open(path, "w:gz") as tf:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("member, words", [(("b/adapter/x", "link", b""), "links and devices"),
                                           (("/abs/x", "file", b"x"), "absolute or '..'"),
                                           (("b/../../x", "file", b"x"), "absolute or '..'")])
def test_an_archive_with_a_link_or_a_path_outside_is_refused_before_anything_is_written(tmp_path, member, words):
    archive = tmp_path / "bundle.tar.gz"
    _tar(archive, [("b/manifest.json", "file", b"{}"), member])
    with pytest.raises(BundleError, match=words):
        unpack(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_good_archive_unpacks_to_its_folder(tmp_path):
    archive = tmp_path / "bundle.tar.gz"
    _tar(archive, [("b/manifest.json", "file", b"{}"), ("b/adapter/manifest.json", "file", b"{}")])
    got = unpack(archive, tmp_path / "out")
    assert got == tmp_path / "out" / "b" and (got / "adapter" / "manifest.json").read_bytes() == b"{}"


def test_a_grpo_bundle_rewards_with_kilns_own_scorer_and_its_data_loads(home, tmp_path):
    """export-grpo: an evaluation suite's prompts, each example's scorer as the reward, Kiln's scoring
    module carried byte for byte; the script's reward function (imported without TRL) scores as
    Kiln scores; the rows load with `datasets`; a changed byte of the scorer fails verify."""
    import importlib.util

    import kiln.native.scoring as scoring
    from conftest import DATA
    r = run("train", "hf", "export-grpo", "--suite", str(DATA / "arith20.json"), "--name", "g1",
            "--num-generations", "4", "--beta", "0.0")
    assert r.exit_code == 0, r.output
    folder = home / "hf" / "g1"
    m = verify(folder)
    assert m["kind"] == "grpo" and m["rows"] == 20 and m["suite"] == "arith20" and m["options"]["beta"] == 0.0
    assert (folder / "kiln_scoring.py").read_bytes() == open(scoring.__file__, "rb").read()
    rows = [json.loads(ln) for ln in (folder / "dataset.jsonl").read_text().splitlines()]
    suite = scoring.read_suite_file(DATA / "arith20.json")
    spec = importlib.util.spec_from_file_location("bundle_train_trl", folder / "train_trl.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    answers = [f"The answer is {ex['target']}." for ex in suite.examples[:3]] + ["I do not know."]
    got = script.reward([[{"role": "assistant", "content": a}] for a in answers],
                        [row["example"] for row in rows[:4]], [row["scorer"] for row in rows[:4]])
    want = [scoring.score(a, ex, ex["scorer"]).score for a, ex in zip(answers, suite.examples[:4])]
    assert got == want and got[:3] == [1.0, 1.0, 1.0] and got[3] == 0.0
    datasets = pytest.importorskip("datasets") if os.environ.get("CI") != "true" else __import__("datasets")
    ds = datasets.load_dataset("json", data_files=str(folder / "dataset.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert len(ds) == 20 and ds[0]["prompt"] == rows[0]["prompt"]
    with open(folder / "kiln_scoring.py", "ab") as f:
        f.write(b"\n")
    with pytest.raises(BundleError, match="files.kiln_scoring.py.bytes"):
        verify(folder)


def test_export_grpo_names_the_bad_field_of_a_suite_and_writes_nothing(home, tmp_path):
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"name": "s", "examples": [{"messages": [{"role": "user", "content": "2+2?"}],
                                                          "target": "4", "scorer": {"type": "nope"}}]}))
    r = run("train", "hf", "export-grpo", "--suite", str(bad), "--name", "g2")
    assert r.exit_code != 0 and "examples[0].scorer" in r.output and "nothing was written" in r.output
    assert not (home / "hf" / "g2").exists()
