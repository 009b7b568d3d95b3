"""The body of the thin Ray actor that runs one worker process on a cluster node.

Ray places it (on the node the supervisor chose) and watches it; Kiln decides everything else.
The actor starts `python -m <worker module>` in a session of its own (a signal to the actor's
process group never reaches it), writes the worker's secrets — the wire's HMAC key, its CURVE
keys — to the process's stdin (so they never touch a disk), and turns the process's exit into an
answer to `wait_exit`. The worker sets PR_SET_PDEATHSIG, so the actor's death (its node lost,
the supervisor gone and Ray reaping its actors) ends the process too.

Plain Python, no Ray import: the supervisor wraps it with `ray.remote` (ray_spawner.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from .node_files import fetch, local_copy

# what Ray puts in its workers' environment that a Kiln worker must not inherit: Ray pins
# OpenMP to the actor's CPU count (1, or 0 → 1), which would run the engine on one core
_DROPPED_ENV = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def boot_id() -> str:
    """This machine's boot id: equal on two processes exactly when they share a kernel (so a pid
    one of them reports is a pid the other can read with psutil)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class NodeHost:
    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.log_path = ""
        self._started = threading.Event()
        self._exited = threading.Event()
        self._error: str | None = None
        self.code: int | None = None

    def start(self, module: str, env: dict, secrets: bytes, log_path: str, banner: str,
              model_file: dict | None = None) -> dict:
        """Start `python -m module` (this node's Python: the one running the actor); its pid and
        where it runs. `model_file`: the worker's model as the supervisor has it — used where it
        is when this node has it (same size), else fetched from the supervisor's file server
        into this node's store and checked first (node_files.py). The process is started by a
        thread that then waits for it: the parent-death signal follows the thread that forked,
        so that thread lives exactly as long as the process."""
        placed = {}
        try:
            self.log_path = self._log_file(log_path)
            placed = self._place_model(model_file, env) if model_file else {}
            full_env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV and not k.startswith("RAY_")}
            full_env.update(env)
            threading.Thread(target=self._run, args=([sys.executable, "-m", module], full_env, secrets, banner),
                             daemon=True, name="kiln-node-host").start()
            self._started.wait()
        except Exception as e:  # noqa: BLE001 - the supervisor reads it as the process's exit reason
            self._error = self._error or f"{type(e).__name__}: {e}"
        if self._error:
            self._exited.set()
            raise OSError(self._error)
        return {"pid": self.proc.pid, "host": socket.gethostname(), "boot_id": boot_id(), "log": self.log_path,
                **placed}

    def _place_model(self, mf: dict, env: dict) -> dict:
        import ray
        path, size = mf["path"], mf["size"]
        if mf["mode"] == "auto" and os.path.isfile(path) and os.path.getsize(path) == size:
            return {"model_path": path, "fetched_bytes": 0}
        server = mf["server"]
        sha = ray.get(server.digest.remote(path))
        store = mf.get("store") or os.path.join(os.environ.get("KILN_HOME") or os.path.expanduser("~/.kiln"),
                                                "models", "cluster")
        target = local_copy(store, mf["node"], path, sha)
        with open(self.log_path, "a") as log:
            n = fetch(lambda at, k: ray.get(server.read.remote(path, at, k)), size, sha, target,
                      lambda line: (log.write(f"--- kiln: {line}\n"), log.flush()))
        settings = json.loads(env.get("KILN_WORKER_SETTINGS") or "{}")
        settings["model"] = target
        env["KILN_WORKER_SETTINGS"] = json.dumps(settings)
        return {"model_path": target, "fetched_bytes": n}

    def _run(self, argv, env, secrets, banner) -> None:
        try:
            log = open(self.log_path, "ab", buffering=0)
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} kiln: {banner} on {socket.gethostname()}\n".encode())
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, close_fds=True, start_new_session=True)
            log.close()
        except OSError as e:
            self._error = f"{type(e).__name__}: {e}"
            self._started.set()
            self._exited.set()
            return
        self._started.set()
        threading.Thread(target=self._watch_node, daemon=True, name="kiln-node-watch").start()
        try:
            self.proc.stdin.write(secrets + b"\n")
            self.proc.stdin.close()
        except OSError:
            pass                                  # it died at once: its exit code says why
        self.code = self.proc.wait()
        self._exited.set()

    def _watch_node(self) -> None:
        """This actor's parent is its node's raylet: once it is gone the node is lost to Ray, which
        declares the actor dead and the supervisor places the worker elsewhere — so the process
        must not live on here, answering as a worker the supervisor no longer has."""
        parent = os.getppid()
        while not self._exited.wait(0.5):
            if os.getppid() != parent:
                self.signal(9)
                os._exit(1)

    @staticmethod
    def _log_file(wanted: str) -> str:
        """The supervisor's log path when this node has its folder (one machine, a shared home),
        else the same name under this node's temporary folder."""
        try:
            os.makedirs(os.path.dirname(wanted), mode=0o700, exist_ok=True)
            return wanted
        except OSError:
            d = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kiln-{os.getuid()}-logs")
            os.makedirs(d, mode=0o700, exist_ok=True)
            return os.path.join(d, os.path.basename(wanted))

    def wait_exit(self) -> dict:
        """Blocks until the process exits: its return code (negative: the signal) and the last
        line it printed (a boot error's reason)."""
        self._exited.wait()
        return {"code": self.code if self.code is not None else 127, "last_line": self._last_line(),
                "error": self._error}

    def signal(self, sig: int) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            self.proc.send_signal(sig)
            return True
        except OSError:
            return False

    def _last_line(self) -> str | None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines()
                         if ln.strip() and not ln.startswith("--- ")]
            return lines[-1].strip()[:500] if lines else None
        except OSError:
            return None
