"""Copies of a model worker ([workers.X] replicas = N, issue 41): how the configuration names them,
and the router's choice among them — the copy with the least outstanding work, another copy when
one dies or loads — with a fake spawner and clock (fast tier)."""

from __future__ import annotations

import pytest

import test_router
from kiln.supervisor.core.config import ConfigError, load_config


def _workers(tmp_path, body: str) -> dict:
    f = tmp_path / "kiln.toml"
    f.write_text(body)
    return load_config(str(f), env={}).workers


def test_replicas_become_named_copies_of_one_group(tmp_path):
    ws = _workers(tmp_path, '[workers.chat]\nkind = "inference"\nmodel = "m.gguf"\nreplicas = 3\n'
                            '[workers.one]\nkind = "inference"\nmodel = "m.gguf"\n')
    assert list(ws) == ["chat", "chat.2", "chat.3", "one"]
    assert {ws[n]["group"] for n in ("chat", "chat.2", "chat.3")} == {"chat"} and "group" not in ws["one"]
    ws["chat.2"]["settings"]["ctx"] = 5
    assert "ctx" not in ws["chat"]["settings"]          # each copy its own settings table


@pytest.mark.parametrize("body, words", [
    ('[workers.t]\nkind = "trainer"\nreplicas = 2\n', "only model workers"),
    ('[workers.c]\nkind = "inference"\nreplicas = 0\n', "out of range"),
])
def test_bad_replicas_are_refused_by_name(tmp_path, body, words):
    with pytest.raises(ConfigError, match=words):
        _workers(tmp_path, body)


@pytest.fixture
def rig(monkeypatch):
    spec = {"kind": "inference", "model": "SmolLM2", "group": "chat"}
    monkeypatch.setattr(test_router, "WORKERS", {"chat": dict(spec), "chat.2": dict(spec)})
    r = test_router.Rig(max_queue=16)
    r.start("chat")
    r.start("chat.2")
    return r


def test_each_request_goes_to_the_copy_with_the_least_outstanding_work(rig):
    for i in range(4):
        rig.generate(f"c{i}", model="chat")
    assert len(rig.requests_to("chat")) == 2 and len(rig.requests_to("chat.2")) == 2
    rig.answer(rig.requests_to("chat")[0], "chat")
    rig.generate("c4", model="chat")
    assert len(rig.requests_to("chat")) == 3                 # the one with a free hand
    assert rig.router.sent == {"chat": 3, "chat.2": 2}


def test_a_copy_named_exactly_gets_its_requests_however_busy(rig):
    for i in range(3):
        rig.generate(f"c{i}", worker="chat.2")
    assert len(rig.requests_to("chat.2")) == 3 and not rig.requests_to("chat")


def test_a_request_of_a_copy_that_died_before_output_runs_on_the_other_copy(rig):
    rig.generate("c0", model="chat")
    rig.generate("c1", model="chat")
    [on_first] = rig.requests_to("chat")
    rig.kill("chat")
    again = [m for m in rig.requests_to("chat.2") if m.id == on_first.id]
    assert again, "the request waited for the dead copy instead of running on the live one"
    assert rig.router.counts["retried"] == 1
