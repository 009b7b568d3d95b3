"""The HTTP front end of the supervisor: health, workers, actions, JSON errors, API key."""

import json
import urllib.error
import urllib.request

import pytest

from daemon_harness import Daemon, spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def request(url, method="GET", body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null"), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), dict(e.headers)


@pytest.fixture
def daemon(tmp_path):
    with Daemon(tmp_path, {"a": spec(), "b": spec()}) as d:
        d.wait_state("a", "running")
        d.wait_state("b", "running")
        yield d


def test_health_is_the_daemons_readiness_with_each_workers_state(daemon):
    """ok; degraded (still 200: the daemon serves) when one worker is down; 503 when none runs."""
    status, body, _ = request(daemon.http + "/health")
    assert status == 200 and body["status"] == "ok"
    assert body["system"]["cpu_count"] >= 1 and body["system"]["ram_total_bytes"] > 0
    request(daemon.http + "/v1/workers/b/stop", "POST")
    daemon.wait_state("b", "stopped")
    status, body, headers = request(daemon.http + "/health")
    assert status == 200 and body["status"] == "degraded" and any("worker b is stopped" in r for r in body["reasons"])
    assert body["workers"]["b"]["state"] == "stopped" and body["workers"]["a"]["state"] == "running"
    request(daemon.http + "/v1/workers/a/stop", "POST")
    daemon.wait_state("a", "stopped")
    status, body, headers = request(daemon.http + "/health")
    assert status == 503 and body["status"] == "unavailable" and "Retry-After" in headers
    assert body["reasons"][0] == "no configured worker is running"


def test_workers_routes(daemon):
    status, body, _ = request(daemon.http + "/v1/workers")
    assert status == 200 and [w["name"] for w in body["data"]] == ["a", "b"]
    w = body["data"][0]
    for key in ("name", "kind", "state", "pid", "uptime_s", "restarts", "last_exit", "rss_bytes", "cpu_percent"):
        assert key in w
    status, one, _ = request(daemon.http + "/v1/workers/a")
    assert status == 200 and one["name"] == "a"
    pid = one["pid"]
    status, _, _ = request(daemon.http + "/v1/workers/a/restart", "POST")
    assert status == 200
    daemon.wait(lambda st: next(x for x in st["workers"] if x["name"] == "a")["pid"] not in (None, pid)
                and next(x for x in st["workers"] if x["name"] == "a")["state"] == "running")


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v1/nope", 404, "not_found"),
    ("GET", "/v1/workers/zz", 404, "unknown_worker"),
    ("POST", "/v1/workers/a/explode", 404, "not_found"),
    ("DELETE", "/health", 405, "method_not_allowed"),
])
def test_errors_are_json(daemon, method, path, status, code):
    got, body, _ = request(daemon.http + path, method)
    assert got == status
    assert body["error"]["code"] == code and body["error"]["message"] and body["error"]["type"]


def test_api_key_guards_everything_but_health(tmp_path):
    with Daemon(tmp_path, {"a": spec()}, server={"api_key": "s3cret"}) as d:
        d.wait_state("a", "running")
        assert request(d.http + "/health")[0] == 200
        status, body, headers = request(d.http + "/v1/workers")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert request(d.http + "/v1/workers", headers={"Authorization": "Bearer nope"})[0] == 401
        assert request(d.http + "/v1/workers", headers={"Authorization": "Bearer s3cret"})[0] == 200
        # GET /v1/config: every effective value and its source, the key itself never (issue 42)
        assert request(d.http + "/v1/config")[0] == 401
        status, cfg, _ = request(d.http + "/v1/config", headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and cfg["server"]["api_key"] == {"value": "(set)", "source": "file"}, cfg["server"]
        assert cfg["supervisor"]["heartbeat_interval"]["source"] in ("default", "file") and "s3cret" not in str(cfg)
        assert set(cfg["workers"]) == {"a"}


def test_cors_is_off_by_default_and_on_for_named_origins(tmp_path):
    with Daemon(tmp_path, {"a": spec()}) as d:
        d.wait_state("a", "running")
        _, _, headers = request(d.http + "/v1/workers", headers={"Origin": "http://localhost:3000"})
        assert "access-control-allow-origin" not in {k.lower() for k in headers}
    (tmp_path / "b").mkdir()
    with Daemon(tmp_path / "b", {"a": spec()}, server={"cors_origins": "http://localhost:3000"}) as d:
        d.wait_state("a", "running")
        _, _, headers = request(d.http + "/v1/workers", headers={"Origin": "http://localhost:3000"})
        assert {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == "http://localhost:3000"
        _, _, headers = request(d.http + "/v1/workers", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in {k.lower() for k in headers}
        status, _, headers = request(d.http + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        assert status == 200 and "POST" in {k.lower(): v for k, v in headers.items()}["access-control-allow-methods"]
