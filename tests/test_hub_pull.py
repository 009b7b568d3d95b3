"""`kiln models pull hf:…` against a local imitation of the hub: resume and checksum."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_path
from fake_hub import FakeHub

pytestmark = pytest.mark.e2e      # starts a daemon (tests/test_layering.py checks)


@pytest.fixture
def hub(tmp_path):
    h = FakeHub()
    h.add("tiny-org/tiny-GGUF", {"tiny-llama.Q8_0.gguf": tiny_path("llama").read_bytes(),
                                 "tiny-qwen3.Q8_0.gguf": tiny_path("qwen3").read_bytes()})
    env = dict(os.environ, HF_ENDPOINT=h.url, HF_HUB_CACHE=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="10")
    yield h, env
    h.close()


def kiln(env, *args):
    return subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def listed(env):
    return {e["name"]: e for e in json.loads(kiln(env, "models", "list", "--json").stdout)}


def test_pull_verifies_and_the_model_is_listed(hub):
    h, env = hub
    r = kiln(env, "models", "pull", "hf:tiny-org/tiny-GGUF/tiny-llama.Q8_0.gguf")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("tiny-llama.Q8_0.gguf")
    entry = listed(env)["hf:tiny-org/tiny-GGUF/tiny-llama.Q8_0.gguf@aaaaaaaa"]
    assert entry["architecture"] == "llama" and not entry["error"]


def test_ctrl_c_leaves_a_resumable_partial_and_the_next_pull_resumes(hub):
    import signal
    import time
    h, env = hub
    h.stall_after["tiny-llama.Q8_0.gguf"] = 150_000
    # SIGINT ignored by whoever started us (a shell's background job, some CI runners) must not
    # make Ctrl-C a no-op for the CLI: start it that way
    p = subprocess.Popen([sys.executable, "-m", "kiln.supervisor.cli", "models", "pull",
                          "hf:tiny-org/tiny-GGUF/tiny-llama.Q8_0.gguf"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert h.stalled.wait(60)
    # the client has written what it received (it writes what arrives: a Ctrl-C loses nothing)
    deadline = time.monotonic() + 30
    while not any(f.stat().st_size == 150_000 for f in Path(env["HF_HUB_CACHE"]).rglob("*.kiln-partial")):
        assert time.monotonic() < deadline, "the partial file never reached the stall point"
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    h.release.set()
    assert p.returncode == 130 and "resume" in err
    assert not any(n.startswith("hf:tiny-org") for n in listed(env)), "a partial file must never be listed"
    r = kiln(env, "models", "pull", "hf:tiny-org/tiny-GGUF/tiny-llama.Q8_0.gguf")
    assert r.returncode == 0, r.stderr
    resumed = [rng for m, path, rng in h.requests if m == "GET" and "resolve" in path][-1]
    assert resumed == "bytes=150000-", h.requests
    entry = listed(env)["hf:tiny-org/tiny-GGUF/tiny-llama.Q8_0.gguf@aaaaaaaa"]
    assert entry["file_bytes"] == tiny_path("llama").stat().st_size and not entry["error"]


def test_a_checksum_mismatch_is_an_error_and_leaves_nothing_listed(hub):
    h, env = hub
    h.corrupt.add("tiny-qwen3.Q8_0.gguf")
    r = kiln(env, "models", "pull", "hf:tiny-org/tiny-GGUF/tiny-qwen3.Q8_0.gguf")
    assert r.returncode == 1 and "checksum mismatch" in r.stderr
    assert not any("tiny-qwen3" in n for n in listed(env))


def test_missing_files_tags_and_registry_names_are_explained(hub):
    h, env = hub
    r = kiln(env, "models", "pull", "hf.co/tiny-org/tiny-GGUF:Q4_K_M")
    assert r.returncode == 1 and "no Q4_K_M GGUF model file" in r.stderr and "quantizations there: Q8_0" in r.stderr
    r = kiln(env, "models", "pull", "hf:tiny-org/tiny-GGUF/other.gguf")
    assert r.returncode == 1 and "no file 'other.gguf'" in r.stderr and "tiny-qwen3.Q8_0.gguf" in r.stderr
    r = kiln(env, "models", "pull", "hf:tiny-org/nope")
    assert r.returncode == 1 and "cannot read tiny-org/nope" in r.stderr
    for name in ("llama3.2:1b", "library/qwen3", "registry.ollama.ai/library/qwen3:4b"):
        r = kiln(env, "models", "pull", name)
        assert r.returncode == 1 and "no Ollama registry here" in r.stderr and "hf.co/" in r.stderr, (name, r.stderr)
    assert not [p for m, p, _ in h.requests if m == "GET" and "resolve" in p], "nothing may be downloaded"


@pytest.fixture
def multi(hub, tmp_path):
    """A repo as people publish them: several quantizations, a vision projector, a split model."""
    from split_gguf import split
    h, env = hub
    parts = split(tiny_path("llama-Q6_K"), tmp_path, 3)
    h.add("tiny-org/multi-GGUF", {
        "tiny-llama-F16.gguf": tiny_path("llama-F16").read_bytes(),
        "tiny-llama-Q4_K_M.gguf": tiny_path("llama-Q4_K_M").read_bytes(),
        "tiny-llama-Q8_0.gguf": tiny_path("llama").read_bytes(),
        "mmproj-tiny-llama-F16.gguf": tiny_path("qwen3").read_bytes(),      # fetched, not run here
        **{f"Q6_K/{p.name}": p.read_bytes() for p in parts}}, sha="b" * 40)
    return h, env


def test_a_quant_tag_picks_the_file_as_llama_server_does(multi):
    h, env = multi
    # no tag: Q4_K_M, with the repo's projector beside it; the choice is said
    r = kiln(env, "models", "pull", "hf.co/tiny-org/multi-GGUF")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("tiny-llama-Q4_K_M.gguf") and "→ tiny-llama-Q4_K_M.gguf" in r.stderr
    snap = Path(r.stdout.strip()).parent
    assert (snap / "mmproj-tiny-llama-F16.gguf").is_file() and "projector mmproj-tiny-llama-F16.gguf" in r.stderr
    # a tag, any case, in llama-server's form: that file; already fetched files are not fetched again
    got = [p for m, p, _ in h.requests if m == "GET" and "resolve" in p]
    r = kiln(env, "models", "pull", "tiny-org/multi-GGUF:q8_0")
    assert r.returncode == 0 and r.stdout.strip().endswith("tiny-llama-Q8_0.gguf"), r.stderr
    fetched = [p for m, p, _ in h.requests if m == "GET" and "resolve" in p][len(got):]
    assert [p.rsplit("/", 1)[-1] for p in fetched] == ["tiny-llama-Q8_0.gguf"], fetched
    # a pulled tag is a model name: the engine resolves it in the hub cache
    out = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "debug", "tokenize", "hf.co/tiny-org/multi-GGUF:Q8_0",
                          "hello"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_hub_listing_a_file_outside_the_repo_gets_nothing_written_there(hub):
    """A hostile hub whose listing names ../ or absolute paths: those names are no files of the
    repo; the pull takes the repo's real model file and writes only inside its snapshot."""
    h, env = hub
    h.add("tiny-org/evil-GGUF", {"../../evil-Q4_K_M.gguf": b"GGUF" + b"\0" * 60,
                                  "/tmp/abs-Q4_K_M.gguf": b"GGUF" + b"\0" * 60,
                                  "tiny-llama-Q8_0.gguf": tiny_path("llama").read_bytes()}, sha="c" * 40)
    r = kiln(env, "models", "pull", "hf.co/tiny-org/evil-GGUF")
    assert r.returncode == 0 and r.stdout.strip().endswith("tiny-llama-Q8_0.gguf"), r.stderr
    cache = Path(env["HF_HUB_CACHE"])
    assert not (cache / "evil-Q4_K_M.gguf").exists() and not (cache.parent / "evil-Q4_K_M.gguf").exists()
    assert not [p for m, p, _ in h.requests if m == "GET" and "evil" in p and "Q4_K_M" in p]
    r = kiln(env, "models", "pull", "hf:tiny-org/evil-GGUF/../../evil-Q4_K_M.gguf")
    assert r.returncode == 1 and "no file" in r.stderr, r.stderr


def test_a_split_model_is_pulled_whole_and_runs_as_the_unsplit_file(multi):
    h, env = multi
    r = kiln(env, "models", "pull", "hf.co/tiny-org/multi-GGUF:Q6_K")
    assert r.returncode == 0, r.stderr
    first = Path(r.stdout.strip())
    assert first.name == "tiny-llama-Q6_K-00001-of-00003.gguf" and "its 2 other parts" in r.stderr
    assert sorted(p.name for p in first.parent.glob("tiny-llama-Q6_K-*.gguf")) == [
        f"tiny-llama-Q6_K-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    entry = next(e for n, e in listed(env).items() if "Q6_K" in n)
    assert entry["parts"] == 3 and entry["file_bytes"] > tiny_path("llama-Q6_K").stat().st_size and not entry["error"]
    shown = json.loads(kiln(env, "models", "inspect", str(first), "--json").stdout)
    assert [Path(p["path"]).name for p in shown["parts"]] == [f"tiny-llama-Q6_K-0000{i}-of-00003.gguf" for i in (1, 2, 3)]

    def greedy(model):
        out = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "debug", "generate", model, "Once upon a time",
                              "--max-tokens", "16", "--json"], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["ids"]
    assert greedy("tiny-org/multi-GGUF:Q6_K") == greedy(str(tiny_path("llama-Q6_K")))
    # a part missing: the model is refused with the part named, never run short of tensors
    (first.parent / "tiny-llama-Q6_K-00003-of-00003.gguf").unlink()
    r = kiln(env, "models", "inspect", str(first))
    assert r.returncode == 1 and "part 3 of 3" in r.stderr and "missing" in r.stderr, r.stderr


def test_a_file_larger_than_the_ram_is_refused_before_downloading(hub):
    h, env = hub
    small = dict(env, KILN_SUPERVISOR_MEMORY_BUDGET="1000")     # "available": 1000 bytes
    r = kiln(small, "models", "pull", "hf:tiny-org/tiny-GGUF/tiny-llama.Q8_0.gguf")
    assert r.returncode != 0 and "would not run here" in r.stderr and "GiB" in r.stderr, r.stderr
    assert not [p for m, p, _ in h.requests if m == "GET" and "resolve" in p], "nothing may be downloaded"
    r = kiln(small, "models", "pull", "--force", "hf:tiny-org/tiny-GGUF/tiny-llama.Q8_0.gguf")
    assert r.returncode == 0, r.stderr


def test_a_request_naming_a_hub_model_not_here_pulls_it_once_then_answers(multi, tmp_path, monkeypatch):
    """As `ollama run` and `llama-server -hf`: the daemon fetches a hub model a request names
    ([models] pull_on_demand), once however many requests wait for it; a pull that fails is the
    request's model_not_found saying why."""
    import threading

    from daemon_harness import Daemon, http_json
    h, env = multi
    for k in ("HF_ENDPOINT", "HF_HUB_CACHE", "HF_HUB_DISABLE_XET", "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
        monkeypatch.setenv(k, env[k])
    home = tmp_path / "home"
    home.mkdir()
    with Daemon(home, {}) as d:
        model = "hf.co/tiny-org/multi-GGUF:Q8_0"
        answers = []

        def ask():
            answers.append(http_json(d, "POST", "/v1/completions", {"model": model, "prompt": "Once upon a time",
                                                                    "max_tokens": 4, "temperature": 0}))
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [s for s, _ in answers] == [200, 200], answers
        assert answers[0][1]["choices"][0]["text"] == answers[1][1]["choices"][0]["text"]
        gets = [p for m, p, _ in h.requests if m == "GET" and "resolve" in p and p.endswith("tiny-llama-Q8_0.gguf")]
        assert len(gets) == 1, gets
        status, out = http_json(d, "POST", "/v1/completions", {"model": "hf.co/tiny-org/multi-GGUF:Q3_K_S",
                                                                "prompt": "Hi", "max_tokens": 2})
        assert status == 400 and out["error"]["code"] == "model_not_found", out       # an unknown model's answer
        assert "could not be pulled" in out["error"]["message"] and "no Q3_K_S" in out["error"]["message"], out
        events = [e["detail"] for e in d.command("events", {"since": 0})["events"] if e["event"] == "pull"]
        assert any(e.startswith("pulled hf.co/tiny-org/multi-GGUF:Q8_0") for e in events), events
