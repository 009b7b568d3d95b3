"""Fast-tier tests of the parity tools: `kiln pi-setup` / `opencode-setup` merging into the
agents' configs (keys kept, backups made, invalid JSON refused), saved sessions (atomic,
listed, exported as a train-sft line), and model integrity (`kiln models verify`)."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from kiln.supervisor.cli.main import app
from kiln.supervisor.core.sessions import SessionError, Sessions

runner = CliRunner()


def run(tmp_path, *args):
    env = {"HOME": str(tmp_path), "KILN_HOME": str(tmp_path / "kiln"), "KILN_MODEL_PATH": ""}
    return runner.invoke(app, list(args), env=env)


def test_pi_setup_keeps_other_keys_and_backs_up(tmp_path):
    agent = tmp_path / ".pi" / "agent"
    agent.mkdir(parents=True)
    (agent / "settings.json").write_text('{"theme": "dark"}')
    (agent / "models.json").write_text('{"providers": {"ollama": {"baseUrl": "http://x/v1"}}}')
    r = run(tmp_path, "pi-setup", "--url", "http://127.0.0.1:9999")
    assert r.exit_code == 0, r.output
    settings = json.loads((agent / "settings.json").read_text())
    assert settings == {"theme": "dark", "defaultProvider": "kiln", "defaultModel": "default"}
    models = json.loads((agent / "models.json").read_text())
    assert models["providers"]["ollama"] == {"baseUrl": "http://x/v1"}
    kiln = models["providers"]["kiln"]
    assert kiln["baseUrl"] == "http://127.0.0.1:9999/v1" and kiln["api"] == "openai-completions"
    assert {"id": "default", "name": "default (Kiln)"} in kiln["models"] and kiln["apiKey"]
    backups = sorted(p.name for p in agent.glob("*.bak-*"))
    assert len(backups) == 2 and backups[1].startswith("settings.json.bak-")
    assert json.loads((agent / backups[1]).read_text()) == {"theme": "dark"}


def test_pi_setup_refuses_invalid_json_and_changes_nothing(tmp_path):
    agent = tmp_path / ".pi" / "agent"
    agent.mkdir(parents=True)
    (agent / "settings.json").write_text("{not json")
    r = run(tmp_path, "pi-setup", "--url", "http://127.0.0.1:9999/v1")
    assert r.exit_code != 0 and "not valid JSON" in r.output
    assert (agent / "settings.json").read_text() == "{not json"
    assert not (agent / "models.json").exists() and not list(agent.glob("*.bak-*"))


def test_opencode_setup(tmp_path):
    conf = tmp_path / ".config" / "opencode"
    conf.mkdir(parents=True)
    (conf / "opencode.json").write_text('{"theme": "opencode", "provider": {"x": {}}}')
    r = run(tmp_path, "opencode-setup", "--url", "http://127.0.0.1:9999", "--model", "smol")
    assert r.exit_code == 0, r.output
    doc = json.loads((conf / "opencode.json").read_text())
    assert doc["theme"] == "opencode" and "x" in doc["provider"] and doc["model"] == "kiln/smol"
    assert doc["provider"]["kiln"]["npm"] == "@ai-sdk/openai-compatible"
    assert doc["provider"]["kiln"]["options"]["baseURL"] == "http://127.0.0.1:9999/v1"
    assert list(conf.glob("opencode.json.bak-*"))


def test_sessions_are_saved_listed_exported_and_removed(tmp_path):
    s = Sessions(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
    s.save("s1", {"model": "default", "adapter": None, "messages": msgs})
    assert not list((tmp_path / "sessions").glob(".*tmp*"))          # no temporary file left
    [row] = s.list()
    assert row["name"] == "s1" and row["turns"] == 1 and row["messages"] == 3
    line = json.loads(s.export_line("s1"))
    assert line == {"messages": msgs}
    from kiln.native.training.sft_data import _check_messages
    assert _check_messages(line) is None                              # a valid `train sft` line
    with pytest.raises(SessionError):
        s.path("../escape")
    s.remove("s1")
    assert s.list() == []


@pytest.fixture
def library(tmp_path, default_model_path):
    models = tmp_path / "kiln" / "models"
    models.mkdir(parents=True)
    shutil.copy(default_model_path, models / default_model_path.name)
    return models / default_model_path.name


def test_one_session_saved_from_many_threads_at_once_is_never_an_error(tmp_path):
    """The daemon's HTTP threads save a session concurrently (the chat page saves twice at once):
    each save writes a temporary file of its own, so none fails and the file is one whole save."""
    import threading
    s, errors = Sessions(tmp_path), []

    def save(k: int) -> None:
        try:
            for j in range(20):
                s.save("busy", {"messages": [{"role": "user", "content": f"{k}-{j}"}]})
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            errors.append(e)
    threads = [threading.Thread(target=save, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(s.load("busy")["messages"]) == 1
    assert not list(tmp_path.rglob(".*tmp*"))                    # no temporary file left behind


@pytest.mark.slow
def test_verify_after_a_pull_then_a_damaged_copy_and_an_unknown_file(tmp_path, library):
    from kiln.native.models.library import pull_default
    pull_default(library.parent)                  # present and verified: records the manifest
    r = run(tmp_path, "models", "verify", "default")
    assert r.exit_code == 0 and r.output.startswith("ok"), r.output
    data = bytearray(library.read_bytes())
    data[70_000_123] ^= 0xFF
    data[70_000_124] ^= 0xFF
    library.write_bytes(bytes(data))
    r = run(tmp_path, "models", "verify", "default", "--json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.output)
    assert out["status"] == "mismatch" and out["first_bad_range"] == [64 * 2**20, library.stat().st_size]
    other = library.with_name("other.gguf")
    shutil.copy(library, other)
    r = run(tmp_path, "models", "verify", "other")
    assert r.exit_code == 2 and "unverified" in r.output
