"""No request deletes, links, reads or probes a file outside the model library or KILN_HOME/data
(issue 35): traversal with `..`, absolute paths, links out of the library, device files as data.
The answer for a path outside is the same whether the file exists or not."""

import os
import shutil
import time

import pytest

from conftest import tiny_path
from daemon_harness import Daemon, http_json, spec
from kiln.native.data_file import DataFileError, read_data_file

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_read_data_file_takes_regular_files_only_and_bounded(tmp_path):
    ok = tmp_path / "ok.jsonl"
    ok.write_bytes(b'{"a": 1}\n')
    assert read_data_file(ok) == b'{"a": 1}\n'
    t0 = time.monotonic()
    for bad, why in (("/dev/zero", "not a regular file"), (str(tmp_path), "not a regular file"),
                     (str(tmp_path / "nope"), "cannot read")):
        with pytest.raises(DataFileError, match=why):
            read_data_file(bad)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                       # nobody writes it: opening must not block
    with pytest.raises(DataFileError, match="not a regular file"):
        read_data_file(fifo)
    with pytest.raises(DataFileError, match="over the 4-byte limit"):
        read_data_file(ok, limit=4)
    assert time.monotonic() - t0 < 2


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    home = tmp_path_factory.mktemp("paths")
    (home / "models").mkdir()
    shutil.copyfile(tiny_path("llama"), home / "models" / "tiny.gguf")
    (home / "data").mkdir()
    (home / "data" / "zero").symlink_to("/dev/zero")          # a link out of the data folder, to a device
    outside = home / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("keep me")
    shutil.copyfile(tiny_path("llama"), outside / "secret.gguf")
    with Daemon(home, {"a": spec()}) as d:
        d.wait_state("a", "running")
        d.outside = outside
        yield d


def test_delete_by_traversal_deletes_nothing(daemon):
    victim = daemon.outside / "victim.txt"
    for name in (f"{daemon.home}/models/../outside/victim.txt", str(victim), "../outside/victim.txt",
                 f"{daemon.home}/models/../outside/secret.gguf"):
        status, body = http_json(daemon, "DELETE", "/api/delete", {"model": name})
        assert status == 400 and "library" in body["error"], (name, status, body)
    assert victim.read_text() == "keep me" and (daemon.outside / "secret.gguf").exists()


def test_copy_cannot_link_a_file_from_outside(daemon):
    status, body = http_json(daemon, "POST", "/api/copy",
                             {"source": f"{daemon.home}/models/../outside/secret.gguf", "destination": "stolen"})
    assert status == 400, body
    assert not (daemon.home / "models" / "stolen.gguf").exists()


def test_a_path_outside_the_library_is_refused_alike_whether_it_exists_or_not(daemon):
    """show, load, plan and generation: the same 400 for a file that exists and one that does not."""
    there, absent = str(daemon.outside / "secret.gguf"), str(daemon.outside / "absent.gguf")
    calls = [("POST", "/api/show", lambda m: {"model": m}),
             ("POST", "/v1/chat/completions", lambda m: {"model": m, "messages": [{"role": "user", "content": "x"}]}),
             ("POST", "/api/generate", lambda m: {"model": m, "prompt": "x"}),
             ("POST", "/api/pull", lambda m: {"model": m, "stream": False})]
    for method, path, body in calls:
        answers = [http_json(daemon, method, path, body(m)) for m in (there, absent, "/etc/passwd")]
        statuses = {a[0] for a in answers}
        assert statuses == {400}, (path, answers)
        texts = [str(a[1]).replace(there, "M").replace(absent, "M").replace("/etc/passwd", "M") for a in answers]
        assert len(set(texts)) == 1, (path, texts)
        assert "allow_paths" in texts[0]
    # a path in the URL: its slashes make it no route at all; a name from the home folder is checked
    assert http_json(daemon, "GET", "/v1/models/" + there.replace("/", "%2F") + "/plan")[0] == 404
    for method, action in (("GET", "plan"), ("POST", "load")):
        status, body = http_json(daemon, method, f"/v1/models/~/{action}")
        assert status == 400 and body["error"]["code"] == "model_path_not_allowed", body


def test_a_library_model_is_named_by_name_or_by_its_path_in_the_library(daemon):
    for name in ("tiny", str(daemon.home / "models" / "tiny.gguf")):
        status, body = http_json(daemon, "POST", "/api/show", {"model": name})
        assert status == 200 and body["details"], (name, body)


@pytest.mark.parametrize("route", ["/v1/train/sft", "/v1/eval/run"])
def test_data_files_come_from_kiln_home_data_only(daemon, route):
    base = {"adapter": "x"} if "train" in route else {}
    t0 = time.monotonic()
    for name, code in (("/dev/zero", "data_path_not_allowed"), ("/etc/passwd", "data_path_not_allowed"),
                       ("../outside/victim.txt", "data_path_not_allowed"), ("zero", "not_a_regular_file"),
                       ("nope.jsonl", "file_not_found")):
        status, body = http_json(daemon, "POST", route, {**base, "file": name})
        assert status == 400 and body["error"]["code"] == code, (name, body)
    assert time.monotonic() - t0 < 5


def test_allow_paths_lets_requests_name_any_file(tmp_path, monkeypatch):
    shutil.copyfile(tiny_path("llama"), tmp_path / "elsewhere.gguf")
    monkeypatch.setenv("KILN_MODELS_ALLOW_PATHS", "true")       # the daemon inherits it
    with Daemon(tmp_path, {"a": spec()}) as d:
        status, body = http_json(d, "POST", "/api/show", {"model": str(tmp_path / "elsewhere.gguf")})
        assert status == 200, body
