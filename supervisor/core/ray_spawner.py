"""The Ray placement backend: each worker process runs under a thin Ray actor on a node the
supervisor chose. Ray places and watches the actor (its own restarts off: the supervisor's policy
stays the one restart rule); the process table drives the handle this module returns exactly as
it drives a local subprocess (`pid`, `poll()`, `send_signal()`, `wait()`).

What crosses to the node: the worker's module, settings and environment, and — through the
actor call, never a file — the wire's HMAC key and the process's own CURVE keypair. The worker
connects back to the supervisor's TCP worker socket, a CURVE server admitting only issued keys
(curve_keys.py).

A node lost (Ray reports the actor dead) reads as the process killed (signal 9) with that reason;
the policy restarts the worker and this spawner places it on a node still alive.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass
from typing import Callable

from .config import BUILTIN_KINDS
from .curve_keys import WorkerKeys
from .node_files import FileServer
from .node_host import NodeHost, boot_id
from .paths import Paths

log = logging.getLogger("kiln.cluster")
MODEL_FILE_KINDS = ("inference", "moe-stream", "stage", "trainer")      # kinds that load a model file


class ClusterError(OSError):
    """The cluster cannot be joined or used (the message says what to do)."""


def reach(address: str, timeout: float = 5.0) -> None:
    """A TCP connection to the cluster's head first: Ray itself waits minutes on an address where
    nothing listens ("auto" it resolves itself, and fails at once when no cluster runs here)."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot reach the Ray cluster at {address!r}: {e} (is `ray start --head` running "
                           f"there, and is its port open? `kiln up --cluster auto` joins the one on this "
                           f"machine)") from None


@dataclass
class Node:
    id: str                         # Ray's node id (hex)
    address: str                    # its IP as Ray knows it
    memory: int                     # Ray's `memory` resource: what the node offers, bytes
    head: bool                      # the node this supervisor runs on
    label: str                      # short name for tables: the address and the id's head

    def describe(self, used: int, workers: list[str]) -> dict:
        return {"node": self.label, "id": self.id, "address": self.address, "memory_bytes": self.memory,
                "planned_bytes": used, "workers": workers, "supervisor": self.head}


class RayWorker:
    """One worker process under its actor: the handle the process table keeps in `w.proc`."""

    def __init__(self, spawner: "RaySpawner", name: str, actor, start_ref, exit_ref, token: str,
                 public: bytes, node: Node):
        self.spawner, self.name, self.actor = spawner, name, actor
        self._start_ref, self._exit_ref = start_ref, exit_ref
        self.token, self.public, self.node = token, public, node
        self.pid: int | None = None
        self.local = False                 # psutil may read its pid (same kernel as the supervisor)
        self.host: str | None = None
        self.returncode: int | None = None
        self.exit_reason: str | None = None
        self.last_line: str | None = None
        self.model_path: str | None = None       # where the node found or put the model
        self.fetched: int | None = None

    def started(self, info: dict) -> None:
        self.pid, self.host = self.pid or info.get("pid"), info.get("host")
        self.model_path, self.fetched = info.get("model_path"), info.get("fetched_bytes")
        if self.fetched:
            self.spawner.record("model_fetched", self.name, f"{self.fetched / 2**20:.0f} MiB to node {self.node.label} "
                                                            f"({self.model_path}), sha256 checked")
        self.local = bool(info.get("boot_id")) and info.get("boot_id") == boot_id()

    def _resolve_start(self) -> None:
        ray = self.spawner.ray
        if self.host is None and ray.wait([self._start_ref], timeout=0)[0]:
            try:
                self.started(ray.get(self._start_ref))
            except Exception:  # noqa: BLE001 - the exit ref says what happened
                pass

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ray = self.spawner.ray
        self._resolve_start()
        if not ray.wait([self._exit_ref], timeout=0)[0]:
            return None
        try:
            got = ray.get(self._exit_ref)
            self.returncode, self.last_line = int(got["code"]), got.get("last_line")
            if got.get("error"):
                self.exit_reason = f"could not start on {self.node.label}: {got['error']}"
                self.spawner.refused[(self.node.id, self.name)] = got["error"]    # its next start goes elsewhere
        except Exception as e:  # noqa: BLE001 - RayActorError & co: the actor (its node) is gone
            self.spawner.forget_nodes()
            self.returncode = -signal.SIGKILL
            self.exit_reason = f"node {self.node.label} lost or its actor died ({type(e).__name__})"
        self.spawner.finished(self)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.actor.signal.remote(int(sig))

    def wait(self, timeout: float | None = None) -> int | None:
        self.spawner.ray.wait([self._exit_ref], timeout=timeout)
        return self.poll()


class RaySpawner:
    """Joins the Ray cluster, chooses a node per worker, starts the actor."""

    def __init__(self, paths: Paths, heartbeat_interval: float, address: str, keys: WorkerKeys,
                 hmac_key: bytes, need: Callable[[str], int] = lambda name: 0,
                 record: Callable[..., None] = lambda *a, **k: None, files: str = "auto", node_store: str = ""):
        """`files`: "auto" (a node uses the model's path when it holds a file of that size there,
        else fetches a checked copy) or "fetch" (every node keeps its own checked copies, in
        `node_store` — empty: KILN_HOME/models/cluster as each node's environment says)."""
        self.paths, self.heartbeat_interval, self.address = paths, heartbeat_interval, address
        self.files_mode, self.node_store = files, node_store
        self.file_server = None
        self.served_files: dict[str, int] = {}   # model paths the file server hands out, with their sizes
        self.keys, self.hmac_key, self.need, self.record = keys, hmac_key, need, record
        self.endpoint: str | None = None         # the worker socket's tcp:// address (set once bound)
        self.ray = None
        self.head_id: str | None = None
        self.placed: dict[str, RayWorker] = {}   # live handles by worker name
        self.specs: dict[str, dict] = {}         # and what they were started with
        self.last_lines: dict[str, str] = {}
        self._nodes: tuple[float, list[Node]] | None = None
        self.refused: dict[tuple, str] = {}      # (node id, worker) -> why the node could not start it

    def connect(self) -> None:
        try:
            import ray
        except ImportError:
            raise ClusterError("cluster.backend = \"ray\" needs Ray: pip install 'kiln[ray]'") from None
        self.ray = ray
        reach(self.address)
        try:
            ray.init(address=self.address, namespace="kiln", log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=False)
        except Exception as e:  # noqa: BLE001 - ConnectionError, a version mismatch, a bad address
            raise ClusterError(f"cannot join the Ray cluster at {self.address!r}: {type(e).__name__}: {e} "
                               f"(start one with `ray start --head`, or set cluster.address / "
                               f"`kiln up --cluster HOST:PORT`)") from None
        self.head_id = ray.get_runtime_context().get_node_id()
        self._host = ray.remote(NodeHost).options
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        # the model files the nodes fetch come from this machine's disk, read by an actor here
        self.file_server = ray.remote(FileServer).options(
            num_cpus=0, max_concurrency=4, name=f"kiln-files-{secrets.token_hex(4)}",
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.head_id, soft=False)).remote()

    def node_ip(self) -> str:
        return self.ray.util.get_node_ip_address()

    def describe(self) -> dict:
        used = self.used()
        return {"endpoint": self.endpoint,
                "nodes": [n.describe(used.get(n.id, 0), sorted(w for w, h in self.placed.items() if h.node.id == n.id))
                          for n in self.nodes()]}

    def nodes(self) -> list[Node]:
        """The nodes alive, as Ray's control store last said (asked at most once a second: a
        status page or a burst of spawns does not become a burst of cluster calls)."""
        now = time.monotonic()
        if self._nodes is None or now - self._nodes[0] >= 1.0:
            self._nodes = (now, self._ask_nodes())
        return self._nodes[1]

    def forget_nodes(self) -> None:
        self._nodes = None

    def _ask_nodes(self) -> list[Node]:
        out = []
        for n in self.ray.nodes():
            if not n.get("Alive"):
                continue
            nid = n["NodeID"]
            out.append(Node(nid, n.get("NodeManagerAddress", "?"), int(n.get("Resources", {}).get("memory", 0)),
                            nid == self.head_id, f"{n.get('NodeManagerAddress', '?')}/{nid[:6]}"))
        return out

    def free(self) -> list[int]:
        """Bytes each node alive offers and Kiln has not placed yet (the placer's question)."""
        used = self.used()
        return [max(0, n.memory - used.get(n.id, 0)) for n in self.nodes()]

    def used(self) -> dict[str, int]:
        """Planned bytes of the workers placed on each node (by node id)."""
        out: dict[str, int] = {}
        for name, h in self.placed.items():
            out[h.node.id] = out.get(h.node.id, 0) + self.need(name)
        return out

    def choose(self, name: str, spec: dict) -> Node:
        nodes = self.nodes()
        if not nodes:
            raise OSError("the Ray cluster has no node alive")
        if spec["kind"] == "moe-stream":
            # its expert cache is a shared-memory segment the supervisor owns, on this machine
            here = [n for n in nodes if n.head]
            if here:
                return here[0]
        used, need = self.used(), self.need(name)
        fits = [n for n in nodes if used.get(n.id, 0) + need <= n.memory]
        skipped = [n for n in fits if (n.id, name) in self.refused]
        if skipped and len(skipped) < len(fits):                 # a node that could not start it: skipped
            fits = [n for n in fits if (n.id, name) not in self.refused]
        elif skipped:
            self.refused = {k: v for k, v in self.refused.items() if k[1] != name}   # every node failed once: try again
        if not fits:
            free = ", ".join(f"{n.label} {(n.memory - used.get(n.id, 0)) / 2**20:.0f} MiB" for n in nodes)
            raise OSError(f"no node of the Ray cluster has {need / 2**20:.0f} MiB free for {name} (free: {free}); "
                          f"add a node (`ray start --address HEAD --memory BYTES`) or lower the model's context")
        count = {n.id: sum(1 for h in self.placed.values() if h.node.id == n.id) for n in nodes}
        # a pipeline's stages on different nodes when they can be: that is what splitting is for
        mates = {h.node.id for w, h in self.placed.items()
                 if spec.get("pipeline") and self.specs.get(w, {}).get("pipeline") == spec["pipeline"]}
        fits = [n for n in fits if n.id not in mates] or fits
        # the fewest workers (replicas spread over the nodes), then a node other than the
        # supervisor's (it serves HTTP too), then the tightest fit (a big hole stays for a big model)
        return min(fits, key=lambda n: (count[n.id], n.head, n.memory - used.get(n.id, 0) - need))

    def spawn(self, name: str, spec: dict) -> RayWorker:
        if self.ray is None or self.endpoint is None:
            raise OSError("the Ray backend is not connected")
        node = self.choose(name, spec)
        module = spec.get("module") or BUILTIN_KINDS[spec["kind"]]
        settings = {"model": spec.get("model"), "threads": spec.get("threads"), **spec.get("settings", {})}
        public, secret = self.keys.issue(name)
        token = secrets.token_hex(8)
        env = {"KILN_WORKER_NAME": name, "KILN_ENDPOINT": self.endpoint, "KILN_SECRETS": "stdin",
               "KILN_WORKER_SETTINGS": json.dumps(settings), "KILN_HEARTBEAT_INTERVAL": str(self.heartbeat_interval),
               "KILN_STATE_DIR": str(self.paths.home), "KILN_HOME": str(self.paths.home), "PYTHONUNBUFFERED": "1"}
        if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
            env["GOMP_SPINCOUNT"] = "30000"           # as processes.py says why
        wire = json.dumps({"hmac": self.hmac_key.hex(), "server_key": self.keys.public.decode(),
                           "public": public.decode(), "secret": secret.decode(), "token": token}).encode()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        try:
            actor = self._host(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=4,
                               name=f"kiln-{name}-{token}",
                               scheduling_strategy=NodeAffinitySchedulingStrategy(node.id, soft=False)).remote()
            start = actor.start.remote(module, env, wire, str(self.paths.worker_log(name)),
                                       f"starting {spec['kind']} worker {name} ({module})",
                                       self._model_file(spec, node))
            exit_ref = actor.wait_exit.remote()
        except Exception as e:  # noqa: BLE001 - the cluster refused the actor
            self.keys.revoke(public)
            raise OSError(f"Ray could not start an actor on {node.label}: {type(e).__name__}: {e}") from None
        h = self.placed[name] = RayWorker(self, name, actor, start, exit_ref, token, public, node)
        self.specs[name] = spec
        return h

    def _model_file(self, spec: dict, node: Node) -> dict | None:
        """The worker's model file as the node should get it (node_host.py), or None: no model,
        or one that does not resolve here — the worker's own boot says what is wrong."""
        if spec["kind"] not in MODEL_FILE_KINDS or not spec.get("model"):
            return None
        from kiln.native.models.library import ModelNotFound, resolve_model
        try:
            path = str(resolve_model(str(spec["model"])))
        except (ModelNotFound, OSError, ValueError):
            return None
        if path not in self.served_files:
            self.served_files[path] = self.ray.get(self.file_server.allow.remote(path), timeout=30)
        return {"path": path, "size": self.served_files[path], "mode": self.files_mode, "store": self.node_store,
                "node": node.id, "server": self.file_server}

    def finished(self, h: RayWorker) -> None:
        """The process is gone: its key opens nothing any more, its actor is ended."""
        self.keys.revoke(h.public)
        if self.placed.get(h.name) is h:
            del self.placed[h.name]
        if h.last_line:
            self.last_lines[h.name] = h.last_line
        try:
            self.ray.kill(h.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone with its node
            pass

    def last_log_line(self, name: str) -> str | None:
        return self.last_lines.get(name)

    def shutdown(self) -> None:
        for h in list(self.placed.values()):
            try:
                self.ray.kill(h.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.placed.clear()
        if self.ray is not None:
            try:
                self.ray.shutdown()
            except Exception:  # noqa: BLE001
                pass
