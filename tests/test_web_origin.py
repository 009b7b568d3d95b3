"""A page on another origin, or one that rebinds its own name to 127.0.0.1, cannot act on Kiln or
read its answers (issue 35): Host, Origin and body type are checked before any route runs — tried
with raw requests, then from a real second origin in Chromium."""

import http.client
import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

from daemon_harness import Daemon, kiln, spec
from kiln.supervisor.core.addresses import check_bind, host_name, is_loopback

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def send(d, method, path, body=b"", headers=None):
    """(status, body text) of one raw request: http.client sends exactly the headers given."""
    host, port = d.http.removeprefix("http://").rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        hdrs = {"Host": f"127.0.0.1:{port}", **(headers or {})}
        for k, v in hdrs.items():
            if v is not None:
                c.putheader(k, v)
        c.putheader("Content-Length", str(len(body)))
        c.endheaders(body)
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        c.close()


def test_host_names_and_loopback():
    assert host_name("[::1]:8420") == "::1" and host_name("LocalHost:80") == "localhost"
    assert host_name("::1") == "::1" and host_name("example.com") == "example.com"
    for name in ("localhost", "127.0.0.1", "127.8.9.10", "::1", "app.localhost"):
        assert is_loopback(name), name
    for name in ("evil.example", "10.0.0.1", "0.0.0.0", "localhost.evil.example", ""):
        assert not is_loopback(name), name


def test_a_bind_beyond_loopback_needs_a_key_or_an_explicit_flag():
    srv = {"host": "0.0.0.0", "port": 8420, "api_key": "", "insecure_no_key": False}
    assert "api_key" in check_bind(srv) and "--insecure-no-key" in check_bind(srv)
    assert check_bind({**srv, "api_key": "k"}) is None
    assert check_bind({**srv, "insecure_no_key": True}) is None
    assert check_bind({**srv, "host": "127.0.0.1"}) is None and check_bind({**srv, "host": "::1"}) is None


def test_kiln_up_beyond_loopback_without_a_key_refuses_to_start(tmp_path):
    r = kiln(tmp_path, "up", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "server.api_key" in r.stderr and "--insecure-no-key" in r.stderr


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    home = tmp_path_factory.mktemp("origin")
    with Daemon(home, {"a": spec()}, server={"cors_origins": "http://friend.test:9"}) as d:
        d.wait_state("a", "running")
        yield d


def running(d) -> bool:
    return d.status()["workers"][0]["state"] == "running"


@pytest.mark.parametrize("path", ["/health", "/ui", "/v1/workers", "/v1/models", "/api/tags", "/metrics"])
def test_a_foreign_host_is_refused_on_every_route(daemon, path):
    status, text = send(daemon, "GET", path, headers={"Host": "evil.example:8420"})
    assert status == 403 and "evil.example" in text


def test_loopback_hosts_are_served(daemon):
    port = daemon.http.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
        assert send(daemon, "GET", "/v1/workers", headers={"Host": host})[0] == 200, host


def test_a_foreign_origin_changes_nothing(daemon):
    """A cross-site 'simple' POST — text/plain, as a form or fetch without preflight sends it."""
    for path in ("/v1/workers/a/stop", "/v1/workers/a/restart", "/api/copy", "/v1/models/x/load"):
        status, text = send(daemon, "POST", path, b'{"source": "a", "destination": "b"}',
                            {"Origin": "http://evil.example", "Content-Type": "text/plain"})
        assert status == 403 and "evil.example" in text, (path, status, text)
        status, _ = send(daemon, "POST", path, b"", {"Origin": "null"})     # a sandboxed frame, a file:// page
        assert status == 403
    assert running(daemon)


def test_same_origin_and_named_origins_are_served(daemon):
    port = daemon.http.rsplit(":", 1)[1]
    for origin in (f"http://127.0.0.1:{port}", "http://friend.test:9"):
        assert send(daemon, "GET", "/v1/workers", headers={"Origin": origin})[0] == 200, origin
    # another port on the same machine is another origin
    assert send(daemon, "GET", "/v1/workers", headers={"Origin": "http://127.0.0.1:1"})[0] == 403


def test_a_body_must_say_it_is_json(daemon):
    body = b'{"model": "nope", "prompt": "x"}'
    for kind in ("text/plain", "multipart/form-data; boundary=x", "application/xml"):
        status, text = send(daemon, "POST", "/v1/completions", body, {"Content-Type": kind})
        assert status == 415 and "application/json" in text, (kind, status, text)
    # JSON is read (this model does not exist: the answer names it, which shows the body got through)
    for kind in ("application/json", "application/json; charset=utf-8", None):
        status, text = send(daemon, "POST", "/v1/completions", body, {"Content-Type": kind})
        assert status in (400, 404) and "nope" in text, (kind, status, text)
    # `curl -d` (Ollama's own examples) sends a form type: accepted without an Origin, never with one
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, text = send(daemon, "POST", "/api/generate", body, form)
    assert status in (400, 404) and "nope" in text, (status, text)
    port = daemon.http.rsplit(":", 1)[1]
    assert send(daemon, "POST", "/api/generate", body, {**form, "Origin": f"http://127.0.0.1:{port}"})[0] == 415


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    (not CHROMIUM or not __import__("importlib").util.find_spec("playwright")) and os.environ.get("CI") != "true",
    reason="no chromium or playwright here")

ATTACK = """<!doctype html><title>elsewhere</title><script>
window.results = (async () => {
  const kiln = new URL(location.search.slice(1));
  const out = {};
  const attempts = {
    stop_text: [`${kiln}v1/workers/a/stop`, {method: "POST", headers: {"Content-Type": "text/plain"}, body: "{}"}],
    stop_nocors: [`${kiln}v1/workers/a/stop`, {method: "POST", mode: "no-cors", body: "{}"}],
    stop_json: [`${kiln}v1/workers/a/stop`, {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}"}],
    read_workers: [`${kiln}v1/workers`, {}],
    read_health: [`${kiln}health`, {}],
  };
  for (const [name, [url, opts]] of Object.entries(attempts)) {
    try { const r = await fetch(url, opts); out[name] = r.type === "opaque" ? "opaque" : await r.text(); }
    catch (e) { out[name] = "refused: " + e.message; }
  }
  return out;
})();
</script>"""


@needs_browser
def test_a_page_on_another_origin_in_chromium_can_neither_act_nor_read(daemon, tmp_path):
    """A real second origin (another port) served beside Kiln, opened in Chromium: its fetches —
    simple, no-cors and preflighted — change nothing and read nothing. Then the same page under a
    name that resolves to 127.0.0.1 (DNS rebinding, by Chromium's resolver rules) opens Kiln's own
    page and API at that name: refused by Host."""
    from playwright.sync_api import sync_playwright
    (tmp_path / "attack.html").write_text(ATTACK)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    kiln_url = daemon.http + "/"
    port = daemon.http.rsplit(":", 1)[1]
    try:
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP rebound.test 127.0.0.1"])
            pg = b.new_page()
            pg.goto(f"http://127.0.0.1:{other.server_port}/attack.html?{kiln_url}")
            got = pg.evaluate("window.results")
            assert all(v.startswith("refused") or v == "opaque" for v in got.values()), got
            assert running(daemon) and daemon.status()["workers"][0]["restarts"] == 0
            # DNS rebinding: the attacker's name now points at this machine
            r = pg.goto(f"http://rebound.test:{port}/v1/workers")
            assert r.status == 403 and "rebound.test" in r.text()
            r = pg.goto(f"http://rebound.test:{port}/ui")
            assert r.status == 403
            b.close()
    finally:
        other.shutdown()
    assert running(daemon)
