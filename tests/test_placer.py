"""Models at run time with a fake spawner, a fake clock and fake plans (fast tier): a request
naming a library model loads it, the budget and max_loaded unload the least recently used idle
model first, a busy or pinned model is never unloaded, an impossible fit is refused with the
numbers, keep_alive expires (0, -1, per request), memory pressure unloads, activate persists."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from fakes import FakeClock, FakeSpawner

from kiln.native.models.library import ModelNotFound
from kiln.protocol import make
from kiln.supervisor.core import policy
from kiln.supervisor.core.placer import Placer
from kiln.supervisor.core.units import parse_duration
from kiln.supervisor.core.process_table import ProcessTable
from kiln.supervisor.core.router import Client, Router, Target

SETTINGS = policy.Settings(start_secs=1.0, max_restarts=3, restart_window=60.0, backoff_initial=0.5,
                           backoff_max=8.0, boot_timeout=10.0, stable_secs=10.0)
GiB = 2**30
LIBRARY = {"small": 1 * GiB, "medium": 2 * GiB, "another": 2 * GiB, "huge": 50 * GiB}


def fake_plan(path: Path, ctx, parallel=None, draft=None, budget=None, kv=("f16", "f16")) -> dict:
    size = LIBRARY[path.stem]
    return {"total_bytes": size + (LIBRARY[draft.stem] if draft else 0), "weights_bytes": size // 2,
            "kv_cache_bytes": size // 4, "runtime_bytes": size // 4, "context": 4096}


class Rig:
    def __init__(self, workers=None, budget=4 * GiB, max_loaded=3, keep_alive=300.0, tmp: Path | None = None):
        self.clock, self.spawner = FakeClock(), FakeSpawner()
        self.events, self.got, self.avail = [], {}, 100 * GiB
        record = lambda e, w, d, **k: self.events.append((e, w, d))  # noqa: E731
        self.table = ProcessTable(workers or {}, SETTINGS, self.spawner, self.clock, record=record,
                                  on_exit=lambda w, how: self.router.on_worker_exit(w, how),
                                  on_ready=lambda w: self.router.pump())
        self.router = Router(self.table, lambda w, m: self.sent.append((w.name, m)), record=record,
                             max_queue=16, wait_for_worker=30.0, request_timeout=100.0)
        self.sent = []
        self.placer = self.router.placer = Placer(
            self.table, budget=budget, max_loaded=max_loaded, keep_alive=keep_alive, pressure_bytes=GiB,
            busy=self.router.busy, record=record, resolve=self._resolve,
            plan=fake_plan,
            available=lambda: self.avail, state_file=(tmp / "models.json") if tmp else None)

    @staticmethod
    def _resolve(model: str) -> Path:
        model = {"default": "small"}.get(model, model)               # as `model = "default"` names a file
        if model.startswith("/models/"):
            model = Path(model).stem
        if model not in LIBRARY:
            raise ModelNotFound(f"model {model!r} not found")
        return Path(f"/models/{model}.gguf")

    def ask(self, cid: str, model: str, **body):
        return self.router.submit("generate", {"messages": [], **body}, Client(cid, lambda m: self.got.setdefault(
            cid, []).append(m), "http"), Target(model=model))

    def hello_all(self):
        for w in list(self.table):
            if w.pid and not w.identity:
                self.table.on_hello(f"{w.name}:{w.pid}".encode(), w.name, w.pid, {"kind": w.kind, "ops": []},
                                    {"state": "ready"})

    def tick(self, dt: float = 0.0):
        self.clock.advance(dt)
        for w in self.table:                    # the workers are alive and well
            if w.identity:
                self.table.on_heartbeat(w, {"state": "ready"})
        self.table.tick()
        self.placer.tick()
        self.router.pump()

    def answer_all(self):
        for name, m in list(self.sent):
            if m.type == "request" and m.id in self.router.pending:
                self.router.on_worker_message(self.table[name], make("reply", id=m.id, body={"text": "ok"}))

    def loaded(self):
        return sorted(l.model for l in self.placer.loaded.values() if not l.unloading)


def test_a_request_naming_a_library_model_loads_it_and_is_served():
    r = Rig()
    r.ask("c1", "small")
    assert r.loaded() == ["small"] and r.table["small"].pid
    assert not [m for _, m in r.sent if m.type == "request"]          # waits for the worker, no 503
    r.hello_all()
    r.tick()
    r.answer_all()
    assert r.got["c1"][-1].type == "reply"
    r.ask("c2", "small")                                             # the same worker again
    assert len(r.spawner.spawned) == 1


def test_a_request_naming_a_booting_configured_workers_file_waits_for_it_instead_of_loading_a_twin():
    r = Rig(workers={"default": {"kind": "inference", "model": "default"}})
    r.table.apply(r.table["default"], policy.Start(manual=False))     # spawned; no hello, no status yet
    for cid, name in (("c1", "small"), ("c2", "/models/small.gguf"), ("c3", "small:latest")):
        r.ask(cid, name)
    assert len(r.spawner.spawned) == 1 and r.loaded() == ["default"]
    r.hello_all()
    r.tick()
    assert sorted(w for w, m in r.sent if m.type == "request") == ["default"] * 3


def test_an_unknown_model_is_404_with_the_reason():
    r = Rig()
    r.ask("c1", "nope")
    assert r.got["c1"][-1].get("code") == "model_not_found"


def test_the_budget_unloads_the_least_recently_used_idle_model_first():
    r = Rig(budget=4 * GiB)
    for cid, m in (("a", "small"), ("b", "medium")):
        r.ask(cid, m)
        r.hello_all()
        r.tick(1)
        r.answer_all()
    r.tick(5)
    r.ask("c", "small")                  # small is now the most recently used
    r.tick(1)
    r.answer_all()
    r.ask("d", "medium")                 # already loaded: nothing moves
    r.answer_all()
    r.tick(1)
    r.ask("e", "small")
    r.answer_all()
    # 1 + 2 GiB loaded; another 2 GiB model would be 5 > 4: the LRU idle one (medium) goes
    LIBRARY["medium2"] = 2 * GiB
    try:
        r.ask("f", "medium2")
    finally:
        del LIBRARY["medium2"]
    assert r.loaded() == ["medium2", "small"]
    assert any(e[0] == "model_unloading" and e[1] == "medium" for e in r.events)
    r.tick()                              # the stopped worker is forgotten
    assert "medium" not in r.table


def test_a_busy_model_is_never_unloaded_and_the_refusal_has_the_numbers():
    r = Rig(budget=3 * GiB)
    r.ask("a", "medium")
    r.hello_all()
    r.tick(1)                              # medium is serving "a" (not answered)
    LIBRARY["other"] = 2 * GiB
    try:
        r.ask("b", "other")
    finally:
        del LIBRARY["other"]
    err = r.got["b"][-1]
    assert err.get("code") == "insufficient_memory" and err.get("retryable")
    assert "GiB" in err.get("message") and "serving a request" in err.get("message")
    assert r.loaded() == ["medium"]


def test_a_model_larger_than_the_budget_is_refused_before_anything_loads():
    r = Rig(budget=4 * GiB)
    r.ask("a", "huge")
    err = r.got["a"][-1]
    assert err.get("code") == "insufficient_memory"
    assert "50.00 GiB" in err.get("message") and "4.00 GiB" in err.get("message")
    assert not r.spawner.spawned


def test_max_loaded_counts_models():
    r = Rig(budget=100 * GiB, max_loaded=1)
    r.ask("a", "small")
    r.hello_all()
    r.tick(1)
    r.answer_all()
    r.ask("b", "medium")
    assert r.loaded() == ["medium"]


def test_pinned_workers_stay():
    r = Rig(workers={"default": {"kind": "inference", "model": "small"}}, budget=2 * GiB, max_loaded=1)
    r.table.apply(r.table["default"], policy.Start(manual=False))
    r.hello_all()
    r.ask("a", "medium")
    assert r.got["a"][-1].get("code") == "insufficient_memory"
    with pytest.raises(Exception, match="pinned|configured"):
        r.placer.unload("default", "test")


def test_a_configured_worker_counts_its_plan_while_it_restarts_and_nothing_once_stopped():
    """A pinned worker's plan (`kiln ps`'s PLANNED) counts against the budget while it has no
    process — crashed and backing off, it will hold that memory again in a moment — so an
    on-demand model does not take its room; stopped by request, it holds nothing."""
    r = Rig(workers={"pinned": {"kind": "inference", "model": "medium"}}, budget=4 * GiB)
    r.placer.plan_pinned()
    assert [m["planned_bytes"] for m in r.placer.describe()] == [2 * GiB]
    pinned = r.table["pinned"]
    r.table.apply(pinned, policy.Start(manual=False))
    r.hello_all()
    r.tick(1.5)
    r.spawner.last("pinned").exit(-signal.SIGKILL)         # crashed: backing off, no process
    r.tick(0)
    assert pinned.ps.state == "backoff" and pinned.pid is None
    r.ask("a", "small")
    r.hello_all()
    r.tick(1)
    r.answer_all()
    r.ask("b", "another")                                   # 2 + 1 + 2 > 4: the idle small one goes
    assert r.loaded() == ["another", "medium"]
    r.tick(SETTINGS.backoff_initial)
    r.hello_all()
    r.tick(1.5)
    r.answer_all()
    assert pinned.ps.state == "running"
    r.table.apply(pinned, policy.Stop())
    r.tick(0)
    r.spawner.last("pinned").exit(0)
    r.tick(0)
    assert pinned.ps.state == "stopped" and r.placer.used_bytes() == 2 * GiB   # "another" alone


def test_a_configured_workers_plan_holds_its_draft_model_and_a_bad_model_counts_nothing_planned():
    r = Rig(workers={"drafted": {"kind": "inference", "model": "medium", "settings": {"draft_model": "small"}},
                     "broken": {"kind": "inference", "model": "missing"}})
    r.placer.plan_pinned()
    assert {m["worker"]: m["planned_bytes"] for m in r.placer.describe()} == {"drafted": 3 * GiB, "broken": None}


def test_keep_alive_expires_idle_models_default_zero_and_forever():
    r = Rig(keep_alive=300.0)
    r.ask("a", "small")
    r.hello_all()
    r.tick(1)
    r.answer_all()
    r.tick(299)
    assert r.loaded() == ["small"]
    r.tick(2)
    assert r.loaded() == []
    r.ask("b", "medium", keep_alive=0)
    assert "keep_alive" not in [m for _, m in r.sent if m.type == "request"][-1].body if r.sent else True
    r.hello_all()
    r.tick(1)
    req = [m for _, m in r.sent if m.type == "request"][-1]
    assert "keep_alive" not in req.body                      # the router's field, not the worker's
    r.answer_all()
    r.tick(0.1)
    assert r.loaded() == []
    r.ask("c", "small", keep_alive="-1")
    r.hello_all()
    r.tick(1)
    r.answer_all()
    r.tick(10_000)
    assert r.loaded() == ["small"]
    r.ask("d", "small", keep_alive="soon")
    assert r.got["d"][-1].get("code") == "invalid_value"


def test_memory_pressure_unloads_idle_models_and_says_so():
    r = Rig(keep_alive=None)
    r.ask("a", "small")
    r.hello_all()
    r.tick(1)
    r.answer_all()
    r.avail = GiB // 2
    r.tick(1)
    assert r.loaded() == []
    assert any(e[0] == "model_unloading" and "memory pressure" in e[2] for e in r.events)


def test_a_crashed_on_demand_worker_is_restarted_like_any_other():
    r = Rig()
    r.ask("a", "small")
    r.hello_all()
    r.tick(20)
    r.spawner.last("small").send_signal(signal.SIGKILL)
    r.tick()
    assert len([n for n, _ in r.spawner.spawned if n == "small"]) == 2


def test_activate_persists_and_routes_requests_naming_no_model(tmp_path):
    r = Rig(tmp=tmp_path)
    r.placer.activate("medium")
    r.router.submit("generate", {}, Client("x", lambda m: None, "http"), Target())
    assert r.loaded() == ["medium"]
    again = Rig(tmp=tmp_path)
    assert again.placer.active == "medium"


def test_a_model_whose_experts_do_not_fit_streams_them():
    r = Rig(budget=4 * GiB)
    real = r.placer.plan
    r.placer.plan = lambda path, ctx, **kw: {**real(path, ctx), "verdict": "streams", "total_bytes": 50 * GiB,
                                             "expert_bytes": 49 * GiB, "expert_cache_bytes": 2 * GiB} \
        if path.stem == "huge" else real(path, ctx)
    r.ask("a", "huge")
    w = r.table["huge"]
    assert w.spec["kind"] == "moe-stream" and w.spec["settings"]["expert_cache"] == "2048MiB"
    assert r.placer.loaded["huge"].planned_bytes == 3 * GiB


def test_models_weights_private_reaches_the_on_demand_workers_settings():
    r = Rig()
    r.ask("a", "small")
    assert "weights" not in r.table["small"].spec["settings"]           # mapped: the worker's default
    r = Rig()
    r.placer.weights = "private"                                         # [models] weights = "private"
    r.ask("a", "small")
    assert r.table["small"].spec["settings"]["weights"] == "private"


@pytest.mark.parametrize("text, seconds", [(300, 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0),
                                           ("0", 0.0), (0, 0.0), (-1, None), ("-1", None), ("250ms", 0.25)])
def test_keep_alive_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "", "5x", True, None])
def test_bad_keep_alive_durations(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_a_plan_is_made_once_per_file_version_off_the_loop_and_errors_are_remembered(tmp_path):
    """PlanCache: `prepare` (on an HTTP thread) plans; the loop's `place` finds the plan, or the
    file's error, without parsing again; a changed file is planned anew."""
    import os
    from kiln.native.gguf_file import GGUFError
    from kiln.supervisor.core.plan_cache import PlanCache
    calls = []

    def plan(path, ctx, parallel=None, draft=None, budget=None, kv=("f16", "f16")):
        calls.append(Path(path).name)
        if Path(path).read_bytes() == b"bad":
            raise GGUFError(f"{path}: block_count 4294967294 is more than the file's 2 blk.N tensors")
        return {"total_bytes": GiB, "weights_bytes": GiB // 2, "kv_cache_bytes": GiB // 4,
                "runtime_bytes": GiB // 4, "context": 4096}
    good, bad = tmp_path / "good.gguf", tmp_path / "bad.gguf"
    good.write_bytes(b"good")
    bad.write_bytes(b"bad")
    cache = PlanCache(plan)
    rig = Rig(budget=8 * GiB)
    rig.placer.plan, rig.placer.resolve_path = cache, lambda m: tmp_path / f"{m}.gguf"
    rig.placer.prepare("good")
    rig.placer.prepare("bad")
    assert calls == ["good.gguf", "bad.gguf"]
    rig.ask("c1", "good")
    rig.ask("c2", "bad")
    assert calls == ["good.gguf", "bad.gguf"], "the loop parsed a file again"
    assert rig.got["c2"][-1].get("code") == "model_invalid" and "block_count" in rig.got["c2"][-1].get("message")
    bad.write_bytes(b"now good")                        # a new version of the file: planned again
    os.utime(bad, ns=(1, 1))
    cache(bad, None)
    assert calls[-1] == "bad.gguf" and len(calls) == 3


def test_an_on_demand_model_gets_the_models_kv_type_in_its_plan_and_its_worker():
    """[models] kv_type (or OLLAMA_KV_CACHE_TYPE, kiln up --kv-type): the plan is asked at that
    type (the real bytes) and the worker is told it."""
    asked = []

    def plan(path, ctx, parallel=None, draft=None, budget=None, kv=("f16", "f16")):
        asked.append(kv)
        return fake_plan(path, ctx, parallel, draft, budget, kv)
    r = Rig()
    r.placer.plan, r.placer.kv = plan, ("q8_0", "q4_0")
    r.ask("c1", "small")
    assert asked == [("q8_0", "q4_0")]
    assert r.table["small"].spec["settings"] == {"ctx": 4096, "kv_type_k": "q8_0", "kv_type_v": "q4_0"}
    r2 = Rig()
    r2.ask("c1", "small")
    assert r2.table["small"].spec["settings"] == {"ctx": 4096}      # f16: nothing said, the default
