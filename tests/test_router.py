"""The router with a fake spawner and a fake clock (fast tier): admission, waiting through a
restart instead of answering 503, retry of requests that produced nothing, cancel, deadlines,
the active adapter and the allow-list for requests workers send up."""

from __future__ import annotations

import signal

import pytest
from fakes import FakeClock, FakeSpawner

from kiln.protocol import make
from kiln.supervisor.core import policy
from kiln.supervisor.core.process_table import ProcessTable
from kiln.supervisor.core.router import MAX_ATTEMPTS, Client, Router, Target

SETTINGS = policy.Settings(start_secs=1.0, max_restarts=3, restart_window=60.0, backoff_initial=0.5,
                           backoff_max=8.0, boot_timeout=10.0, stable_secs=10.0)
WORKERS = {"default": {"kind": "inference", "model": "SmolLM2"},
           "evaluator": {"kind": "evaluator"}, "trainer": {"kind": "trainer"}}


class Adapters:
    def __init__(self):
        self.active_name, self.known = None, {"kind"}

    def active(self):
        return self.active_name

    def get(self, name):
        if name not in self.known:
            raise KeyError(f"no adapter named {name!r}")
        return {"name": name}


class Rig:
    def __init__(self, **router_kw):
        self.clock, self.spawner = FakeClock(), FakeSpawner()
        self.sent: list[tuple[str, object]] = []          # (worker, message) the router sent
        self.events = []
        self.table = ProcessTable(WORKERS, SETTINGS, self.spawner, self.clock, heartbeat_interval=1.0,
                                  liveness=3, graceful_timeout=5.0,
                                  record=lambda e, w, d: self.events.append((e, w, d)),
                                  on_exit=lambda w, how: self.router.on_worker_exit(w, how),
                                  on_ready=lambda w: self.router.pump())
        self.adapters = Adapters()
        self.router = Router(self.table, lambda w, m: self.sent.append((w.name, m)), adapters=self.adapters,
                             record=lambda e, w, d: self.events.append((e, w, d)),
                             **{"max_queue": 4, "wait_for_worker": 30.0, "request_timeout": 100.0, **router_kw})
        self.got: dict[str, list] = {}

    def client(self, cid: str, replayable: bool = False) -> Client:
        return Client(cid, lambda m: self.got.setdefault(cid, []).append(m), "http", replayable)

    def start(self, name: str = "default", ready: bool = True):
        w = self.table[name]
        self.table.apply(w, policy.Start(manual=False))
        if ready:
            self.hello(name)

    def hello(self, name: str = "default", state: str = "ready"):
        w = self.table[name]
        self.table.on_hello(f"{name}:{w.pid}".encode(), name, w.pid, {"kind": w.kind, "ops": []}, {"state": state})

    def tick(self, dt: float = 0.0):
        self.clock.advance(dt)
        self.table.tick()
        self.router.pump()

    def kill(self, name: str = "default"):
        self.spawner.last(name).send_signal(signal.SIGKILL)
        self.tick()

    def generate(self, cid: str, replayable: bool = False, **target):
        return self.router.submit("generate", {"messages": []}, self.client(cid, replayable), Target(**target))

    def requests_to(self, name: str = "default"):
        return [m for n, m in self.sent if n == name and m.type == "request"]

    def answer(self, msg, name: str = "default", type_: str = "reply", **fields):
        self.router.on_worker_message(self.table[name], make(type_, id=msg.id, body={"text": "ok"}, **fields))


def test_a_ready_worker_gets_the_request_and_the_client_its_reply():
    r = Rig()
    r.start()
    r.generate("c1")
    [req] = r.requests_to()
    assert req.get("op") == "generate" and req.body == {"messages": []}
    r.answer(req, type_="chunk")
    r.answer(req)
    assert [m.type for m in r.got["c1"]] == ["chunk", "reply"]
    assert all(m.id == "c1" for m in r.got["c1"]) and r.got["c1"][-1].get("worker") == "default"
    assert not r.router.pending


def test_a_request_while_the_worker_loads_waits_for_it_not_503():
    r = Rig()
    r.start(ready=False)
    r.generate("c1")
    r.tick(5.0)
    assert not r.requests_to() and "c1" not in r.got
    r.hello(state="loading")
    r.tick(1.0)
    assert not r.requests_to()                         # generation waits until the model is loaded
    r.table.on_heartbeat(r.table["default"], {"state": "ready"})
    assert len(r.requests_to()) == 1


def test_the_wait_for_a_worker_ends_with_503_and_retry_after():
    r = Rig(wait_for_worker=10.0)
    r.start(ready=False)
    r.generate("c1")
    r.tick(9.9)
    assert "c1" not in r.got
    r.tick(0.2)
    [err] = r.got["c1"]
    assert err.get("code") == "worker_unavailable" and err.get("retry_after") == 2 and err.get("retryable")
    assert "did not become ready within 10 s" in err.get("message")


def test_a_full_queue_is_503_server_busy_with_retry_after():
    r = Rig(max_queue=2)
    r.start()
    r.generate("c1"), r.generate("c2")
    assert r.generate("c3") is None
    [err] = r.got["c3"]
    assert err.get("code") == "server_busy" and err.get("retry_after") == 1
    r.answer(r.requests_to()[0])
    assert r.generate("c4") is not None                # a slot came free


def test_a_request_that_produced_nothing_is_retried_on_the_restarted_worker():
    r = Rig()
    r.start()
    r.generate("c1")
    first = r.requests_to()[-1]
    r.tick(20.0)                                       # served 20 s (> stable_secs): restarted at once
    r.kill()
    assert "c1" not in r.got and r.table["default"].ps.state == "starting"
    r.hello()
    second = r.requests_to()[-1]
    assert second.id == first.id and len(r.requests_to()) == 2
    r.answer(second)
    reply = r.got["c1"][-1]
    assert reply.type == "reply" and reply.get("retried_after") == ["signal 9 (SIGKILL)"]
    assert r.router.counts["retried"] == 1 and any(e[0] == "request_retried" for e in r.events)


def test_a_request_that_had_produced_output_ends_with_worker_crashed():
    r = Rig()
    r.start()
    r.generate("c1")
    r.answer(r.requests_to()[-1], type_="chunk")
    r.kill()
    assert [m.type for m in r.got["c1"]] == ["chunk", "error"]
    assert r.got["c1"][-1].get("code") == "worker_crashed" and r.got["c1"][-1].get("retryable") is True


def test_a_whole_answer_that_had_produced_output_is_dropped_and_run_again():
    """A client that shows nothing before the reply (a non-streamed HTTP answer) loses nothing when
    the worker dies after output: it is told to drop what it got, and the request runs again."""
    r = Rig()
    r.start()
    r.generate("c1", replayable=True)
    first = r.requests_to()[-1]
    r.answer(first, type_="chunk")
    r.kill()
    assert [m.type for m in r.got["c1"]] == ["chunk", "restart"]
    assert r.got["c1"][-1].get("reason") == "signal 9 (SIGKILL)" and r.router.pending
    r.tick(SETTINGS.backoff_initial)
    r.hello()
    second = r.requests_to()[-1]
    assert second.id == first.id and len(r.requests_to()) == 2
    r.answer(second, type_="chunk")
    r.answer(second)
    assert [m.type for m in r.got["c1"]] == ["chunk", "restart", "chunk", "reply"]
    assert r.got["c1"][-1].get("retried_after") == ["signal 9 (SIGKILL)"]
    assert any(e[0] == "request_retried" and "had not shown" in e[2] for e in r.events)


def test_a_whole_answer_that_kills_its_worker_every_time_stops_after_max_attempts():
    r = Rig()
    r.start()
    r.generate("c1", replayable=True)
    for attempt in range(MAX_ATTEMPTS):
        r.answer(r.requests_to()[-1], type_="chunk")
        r.kill()
        r.tick(SETTINGS.backoff_initial)
        r.hello()
        r.tick(1.0)
    assert len(r.requests_to()) == MAX_ATTEMPTS
    assert [m.type for m in r.got["c1"]][-2:] == ["chunk", "error"]
    assert r.got["c1"][-1].get("code") == "worker_crashed" and not r.router.pending


def test_a_request_that_kills_its_worker_every_time_stops_after_max_attempts():
    r = Rig()
    r.start()
    r.generate("c1")
    for attempt in range(MAX_ATTEMPTS):
        assert len(r.requests_to()) == attempt + 1
        r.kill()
        r.tick(SETTINGS.backoff_initial)               # a short-lived crash: a short pause
        r.hello()
        r.tick(1.0)
    assert len(r.requests_to()) == MAX_ATTEMPTS
    assert r.got["c1"][-1].get("code") == "worker_crashed" and f"{MAX_ATTEMPTS} attempts" in r.got["c1"][-1].get("message")


def test_a_fatal_worker_is_answered_at_once_without_retry_after_and_with_the_fix():
    r = Rig()
    r.start(ready=False)
    w = r.table["default"]
    w.boot_reason = "model file /x.gguf: no such file"
    r.spawner.last("default").exit(3)
    r.tick()
    r.generate("c1")
    [err] = r.got["c1"]
    assert err.get("code") == "worker_fatal" and err.get("retry_after") is None and not err.get("retryable")
    assert "/x.gguf" in err.get("message") and "kiln restart default" in err.get("message")


def test_waiting_requests_fail_when_their_worker_turns_fatal():
    r = Rig()
    r.start(ready=False)
    r.generate("c1")
    r.table["default"].boot_reason = "corrupt file"
    r.spawner.last("default").exit(3)
    r.tick()
    assert r.got["c1"][-1].get("code") == "worker_fatal"


@pytest.mark.parametrize(("target", "code"), [({"model": "nope"}, "model_not_found"),
                                              ({"worker": "nope"}, "unknown_worker")])
def test_unknown_targets_are_clear_errors_at_once(target, code):
    r = Rig()
    r.start()
    r.generate("c1", **target)
    assert r.got["c1"][-1].get("code") == code and "nope" in r.got["c1"][-1].get("message")


def test_a_model_is_found_by_worker_name_or_model_name():
    r = Rig()
    r.start()
    r.generate("c1", model="SmolLM2")
    r.generate("c2", model="default")
    assert len(r.requests_to()) == 2


def test_the_deadline_cancels_on_the_worker_and_answers_504():
    r = Rig(request_timeout=5.0)
    r.start()
    r.generate("c1")
    req = r.requests_to()[-1]
    r.tick(5.1)
    assert r.got["c1"][-1].get("code") == "deadline_exceeded" and "(5 s)" in r.got["c1"][-1].get("message")
    assert any(m.type == "cancel" and m.id == req.id for _, m in r.sent)
    r.answer(req)                                      # late traffic is dropped
    assert len(r.got["c1"]) == 1


def test_a_client_cancel_reaches_the_worker_and_frees_the_slot():
    r = Rig()
    r.start()
    r.generate("c1")
    req = r.requests_to()[-1]
    r.router.cancel_client("c1", "http")
    assert any(m.type == "cancel" and m.id == req.id for _, m in r.sent) and not r.router.pending


def test_a_worker_that_stops_mid_request_hands_it_to_its_successor():
    r = Rig()
    r.start()
    r.generate("c1")
    req = r.requests_to()[-1]
    r.answer(req, type_="error", code="shutting_down")
    assert "c1" not in r.got and r.router.waiting() == 1


def test_a_worker_that_stops_mid_answer_hands_a_whole_answer_to_its_successor_and_ends_a_stream():
    r = Rig()
    r.start()
    r.generate("whole", replayable=True)
    r.generate("stream")
    for req in r.requests_to():
        r.answer(req, type_="chunk")
        r.answer(req, type_="error", code="shutting_down")
    assert [m.type for m in r.got["whole"]] == ["chunk", "restart"] and r.router.waiting() == 1
    assert [m.type for m in r.got["stream"]] == ["chunk", "error"]   # it had shown output: it cannot rerun


def test_the_active_adapter_applies_unless_the_request_names_one():
    r = Rig()
    r.start()
    r.adapters.active_name = "kind"
    r.generate("c1")
    assert r.requests_to()[-1].body["adapter"] == "kind"
    assert r.router.pending[r.requests_to()[-1].id].adapter == "kind"
    r.router.submit("generate", {"adapter": ""}, r.client("c2"), Target())
    assert r.requests_to()[-1].body["adapter"] == ""
    r.router.submit("generate", {"adapter": "missing"}, r.client("c3"), Target())
    assert r.got["c3"][-1].get("code") == "adapter_not_found"


def test_job_ops_go_to_the_worker_of_their_kind():
    r = Rig()
    r.start("trainer")
    r.router.submit("job_cancel", {"id": "t1"}, r.client("c1"), Target(kind="trainer"))
    assert r.requests_to("trainer")[-1].get("op") == "job_cancel"


def test_a_worker_may_send_up_only_what_its_kind_is_allowed():
    r = Rig()
    r.start()
    r.start("evaluator")
    ev = r.table["evaluator"]
    up: list = []
    r.router.on_worker_request(ev, make("request", id="u1", op="adapters.delete", body={"name": "x"}), up.append)
    assert up[-1].get("code") == "forbidden" and "generate" in up[-1].get("message")
    r.router.on_worker_request(ev, make("request", id="u2", op="generate", body={"messages": [], "worker": "default"}),
                               up.append)
    req = r.requests_to("default")[-1]
    assert req.body == {"messages": []}
    r.answer(req)
    assert up[-1].type == "reply" and up[-1].id == "u2"
    r.start("trainer")
    r.router.on_worker_request(r.table["trainer"], make("request", id="u3", op="generate", body={}), up.append)
    assert up[-1].get("code") == "forbidden" and "nothing" in up[-1].get("message")


def test_shutdown_fails_every_pending_request_and_refuses_new_ones():
    r = Rig()
    r.start()
    r.generate("c1")
    r.router.fail_all("shutting_down", "kiln is shutting down")
    assert r.got["c1"][-1].get("code") == "shutting_down"
    r.generate("c2")
    assert r.got["c2"][-1].get("code") == "shutting_down"


@pytest.mark.parametrize("min_ctx", ["4096", 1.5, True, -1, 0, [1]])
def test_a_min_ctx_that_is_not_a_context_is_refused_at_admission(min_ctx):
    """From the control socket or a worker's request it is unchecked until here: never an
    exception on the loop."""
    r = Rig()
    r.start()
    r.router.submit("generate", {"messages": [], "min_ctx": min_ctx}, r.client("c1"), Target())
    assert r.got["c1"][-1].get("code") == "invalid_value" and not r.requests_to() and not r.router.pending


def test_a_worker_whose_context_is_shorter_than_min_ctx_refuses_the_request():
    r = Rig()
    r.start()
    r.table["default"].status["n_ctx"] = 512
    r.router.submit("generate", {"messages": [], "min_ctx": 4096}, r.client("c1"), Target())
    assert r.got["c1"][-1].get("code") == "context_too_small" and "4096" in r.got["c1"][-1].get("message")
    r.router.submit("generate", {"messages": [], "min_ctx": 512}, r.client("c2"), Target())
    [req] = r.requests_to()
    assert "min_ctx" not in req.body
