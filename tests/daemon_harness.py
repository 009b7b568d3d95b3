"""A real `kiln up` in a temporary KILN_HOME, for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from kiln.supervisor.bus.client import ControlClient
from kiln.supervisor.core.paths import Paths

TESTS = Path(__file__).parent


def spec(**settings) -> dict:
    return {"kind": "test", "module": "kiln_test_worker", "settings": settings}


def _toml_value(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def write_config(home: Path, workers: dict, supervisor: dict | None = None, server: dict | None = None,
                 cluster: dict | None = None) -> Path:
    sv = {"heartbeat_interval": 0.2, "liveness": 3, "graceful_timeout": 2.0, "start_secs": 0.3,
          "backoff_initial": 0.2, "backoff_max": 1.0, "max_restarts": 5, "restart_window": 30.0,
          "drain_timeout": 2.0, **(supervisor or {})}
    srv = {"port": 0, **(server or {})}
    lines = ["[server]"] + [f"{k} = {_toml_value(v)}" for k, v in srv.items()]
    lines += ["[supervisor]"] + [f"{k} = {_toml_value(v)}" for k, v in sv.items()]
    if cluster:
        lines += ["[cluster]"] + [f"{k} = {_toml_value(v)}" for k, v in cluster.items()]
    for name, spec in workers.items():
        lines.append(f"[workers.{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in spec.items()]
    path = home / "kiln.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def env_for(home: Path) -> dict:
    env = dict(os.environ, KILN_HOME=str(home), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for k in list(env):
        if k.startswith(("KILN_SERVER_", "KILN_SUPERVISOR_")) or k == "KILN_CONFIG":
            del env[k]
    return env


def http_json(d: "Daemon", method: str, path: str, body=None) -> tuple[int, object]:
    """(status, parsed JSON) of one request to the daemon's HTTP API; errors are answers too."""
    req = urllib.request.Request(d.http + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def kiln(home: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", *args], env=env_for(home),
                          capture_output=True, text=True, timeout=timeout, cwd=home)


class Daemon:
    def __init__(self, home: Path, workers: dict, supervisor: dict | None = None,
                 server: dict | None = None, extra_args: tuple = (), blocked_signals: frozenset = frozenset(),
                 command: str = "up", cluster: dict | None = None):
        self.home = Path(home)
        self.command_name = command              # `kiln up`, or `kiln serve MODEL`
        self.blocked_signals = blocked_signals   # a signal mask `kiln up` inherits, as from some CI runners
        self.config = write_config(self.home, workers, supervisor, server, cluster)
        self.extra_args = extra_args
        self.paths = None
        self.proc: subprocess.Popen | None = None
        self.seen_pids: set[int] = set()

    def start(self, wait_for=None, timeout: float = 30.0) -> "Daemon":
        env = env_for(self.home)
        log = open(self.home / "daemon.out", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.supervisor.cli", self.command_name, "--config",
                                      str(self.config), *self.extra_args],
                                     env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.home,
                                     preexec_fn=(lambda: signal.pthread_sigmask(signal.SIG_BLOCK, self.blocked_signals))
                                     if self.blocked_signals else None)
        old = os.environ.get("KILN_HOME")
        os.environ["KILN_HOME"] = str(self.home)
        try:
            self.paths = Paths.from_env()
        finally:
            if old is None:
                del os.environ["KILN_HOME"]
            else:
                os.environ["KILN_HOME"] = old
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln up exited {self.proc.returncode}: {self.output()}")
            if (self.paths.run / "control.sock").exists() and self.paths.keyfile.exists():
                try:
                    self.status()
                    break
                except Exception:  # noqa: BLE001 - not ready yet
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kiln up not ready: {self.output()}")
            time.sleep(0.05)
        if wait_for:
            self.wait(wait_for, timeout)
        return self

    def output(self) -> str:
        return (self.home / "daemon.out").read_text(errors="replace")[-3000:]

    def client(self, timeout: float = 15.0) -> ControlClient:
        return ControlClient(self.paths, timeout)

    def command(self, name: str, args: dict | None = None):
        with self.client() as c:
            return c.command(name, args or {})

    def status(self) -> dict:
        st = self.command("status")
        for w in st["workers"]:
            if w["pid"]:
                self.seen_pids.add(w["pid"])
        return st

    def worker(self, name: str) -> dict:
        return next(w for w in self.status()["workers"] if w["name"] == name)

    def wait(self, predicate, timeout: float = 20.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.status()
            got = predicate(last)
            if got:
                return got
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what}; last status: {json.dumps(last)[:2000]}")

    def wait_state(self, name: str, state: str, timeout: float = 20.0) -> dict:
        return self.wait(lambda st: next((w for w in st["workers"] if w["name"] == name and w["state"] == state), None),
                         timeout, f"{name} to be {state}")

    @property
    def http(self) -> str:
        host, port = self.status()["daemon"]["http"]
        return f"http://{host}:{port}"

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, as a user's `kill` would; a daemon that does not stop fails the test."""
        hung = None
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGUSR1)     # faulthandler: every thread's stack
                time.sleep(1)
                self.proc.kill()
                self.proc.wait()
                hung = f"kiln up ignored SIGTERM for {timeout:g} s; its output:\n{self.output()}"
        # no orphans: every worker pid we saw must be gone
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and [p for p in self.seen_pids if psutil.pid_exists(p)
                                               and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
            time.sleep(0.05)
        for p in self.seen_pids:
            if psutil.pid_exists(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if hung:
            raise AssertionError(hung)

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type, *_):
        try:
            self.stop()
        except AssertionError:
            if exc_type is None:       # else the test's own failure is the one to show
                raise
