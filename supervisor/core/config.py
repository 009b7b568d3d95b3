"""Configuration: defaults < kiln.toml < KILN_<SECTION>_<FIELD> environment < command-line flags.

Every effective value remembers where it came from (`default|file|env|cli`). Unknown keys and
bad values are errors that name the key and what is allowed. Workers are declared in
`[workers.<name>]` tables with a `kind` and their own settings.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config_fields import ConfigError, Field, coerce as _coerce  # noqa: F401  (re-exported)
from .worker_config import (BUILTIN_KINDS, DEFAULT_WORKERS, KIND_SETTINGS, KV_SETTINGS, KV_TYPES,  # noqa: F401
                            WORKER_FIELDS, _split, _worker)                                    # (re-exported)

WEIGHTS = ("mapped", "private")   # a model worker's weights (kiln.native.model.WEIGHTS: the supervisor
                                  # does not import the engine to read it; a test keeps them equal)
KV_ENV_ALIAS = "OLLAMA_KV_CACHE_TYPE"   # Ollama's name for models.kv_type, honoured when Kiln's is not set

SCHEMA: dict[str, dict[str, Field]] = {
    "server": {
        "host": Field(str, "127.0.0.1", "HTTP listen address"),
        "port": Field(int, 8420, "HTTP port", 0, 65535),
        "api_key": Field(str, "", "bearer key required on every route but /health (empty: none)"),
        "max_body_bytes": Field(int, 32 * 2**20, "largest request body accepted (images come base64 in it)", 1024, None),
        "fetch_images": Field(bool, False, "fetch an image a request names by http(s) URL (never from a loopback, "
                              "private or link-local address; off: such a request is a 400 — send the bytes)"),
        "threads": Field(int, 32, "HTTP threads: each running request or open stream holds one; 4 are kept for "
                         "health, reads and control, so at most threads - 4 requests stream at once (more: 503)", 5, 512),
        "max_event_streams": Field(int, 8, "open /v1/events streams (dashboards, `kiln status --watch`) at once; "
                                   "more: 503", 1, 256),
        "max_queue": Field(int, 64, "requests waiting for a worker before 503 'server busy'", 1, 100000),
        "request_timeout": Field(float, 600.0, "longest a request may take, seconds", 1, None),
        "cors_origins": Field(str, "", "browser origins allowed to call the API from other pages, comma-separated "
                              "(e.g. http://localhost:3000 for Open WebUI; empty: none; * : any)"),
        "allowed_hosts": Field(str, "", "names this server is reached by besides loopback ones, comma-separated: "
                               "a request whose Host is another name is refused (DNS rebinding; * : any). "
                               "A bind beyond loopback adds its own addresses"),
        "insecure_no_key": Field(bool, False, "serve beyond loopback without an api_key (anyone who reaches the "
                                 "port can run, change and stop Kiln): only behind a firewall or a proxy that "
                                 "decides who gets in"),
        "wait_for_worker": Field(float, 60.0, "longest a request waits for its worker to start or restart "
                                 "before 503, seconds", 0, None),
        "stream_keepalive": Field(float, 10.0, "seconds of silence in a stream (a long prompt's prefill) before a "
                                  "keep-alive is sent, so that clients with an idle timeout wait", 0.1, 3600),
    },
    "supervisor": {
        "heartbeat_interval": Field(float, 1.0, "seconds between worker heartbeats", 0.05, 60),
        "liveness": Field(int, 3, "missed heartbeats before a worker is declared dead", 1, 100),
        "progress_timeout": Field(float, 30.0, "seconds a worker that misses heartbeats while its CPU time advances "
                                  "(a long computation holding it) has before it is judged hung; a stopped "
                                  "or idle silent worker still has `liveness` heartbeats", 0, 3600),
        "graceful_timeout": Field(float, 5.0, "seconds between SIGTERM and SIGKILL", 0.1, 600),
        "drain_timeout": Field(float, 30.0, "on shutdown, seconds the requests in flight may take to finish "
                               "before they are cut (new ones are refused at once; 0: cut at once)", 0, 3600),
        "start_secs": Field(float, 1.0, "seconds a worker must stay up after hello to be running", 0, 600),
        "max_restarts": Field(int, 5, "failed starts in a row (within restart_window) before fatal", 1, 1000),
        "restart_window": Field(float, 60.0, "seconds over which failed starts are counted", 1, None),
        "backoff_initial": Field(float, 0.5, "restart delay after a short-lived crash, seconds (doubles for "
                                 "each failed start in a row)", 0, 600),
        "stable_secs": Field(float, 10.0, "seconds a worker must have run for its crash to restart it at once", 0, None),
        "backoff_max": Field(float, 30.0, "longest restart delay, seconds", 0, 3600),
        "boot_timeout": Field(float, 120.0, "seconds a worker may take from spawn to hello, and stay silent while it loads a model", 1, None),
        "memory_budget": Field(int, 0, "bytes a model may plan to use (0: the RAM available)", 0, None),
    },
    "models": {
        "on_demand": Field(bool, True, "load a library model when a request names it"),
        "pull_on_demand": Field(bool, True, "pull a Hugging Face model a request names (hf.co/ORG/REPO:QUANT) "
                                "that is not here yet, then load it; off: such a request is a 404"),
        "allow_paths": Field(bool, False, "let HTTP requests name a model by any file path this user can read "
                             "(off: only library models and configured workers' models; the CLI may always)"),
        "keep_alive": Field(str, "5m", "how long an on-demand model stays loaded after its last request "
                            "(300, \"5m\", \"1h\"; 0: unload after each answer; -1: keep)"),
        "max_loaded": Field(int, 3, "most models loaded at once, configured ones included (0: no limit)", 0, 1000),
        "memory_budget": Field(str, "auto", "memory the loaded models may plan to use: a size (8GiB, 500MB), "
                               "a share of RAM (60%), or auto: the RAM available at start minus min_available"),
        "min_available": Field(str, "512MiB", "below this much available RAM, idle on-demand models are "
                               "unloaded (memory pressure); a size or a share of RAM"),
        "ctx": Field(int, 0, "context of an on-demand model (0: sized by the memory budget — the largest of its "
                     "trained context up to 32768, 16384, 8192, 4096, … whose KV cache fits)", 0, 1 << 24),
        "kv_type": Field(str, "f16", "the KV cache of every model: f16, or q8_0 / q4_0 for about half / a "
                         "quarter of its memory (a longer context in the same RAM) at a small cost in "
                         "fidelity; a worker's settings.kv_type overrides it (also: OLLAMA_KV_CACHE_TYPE)",
                         choices=KV_TYPES),
        "kv_type_k": Field(str, "", "the keys' type only, as llama.cpp's -ctk (empty: kv_type)", choices=("",) + KV_TYPES),
        "kv_type_v": Field(str, "", "the values' type only, as llama.cpp's -ctv (empty: kv_type)", choices=("",) + KV_TYPES),
        "weights": Field(str, "mapped", "an on-demand model's weights: mapped (the file's page cache, shared) or "
                         "private (copied into huge pages: faster decode where the page cache holds 4 KiB pages)",
                         choices=WEIGHTS),
    },
    "cluster": {
        "backend": Field(str, "local", "where workers run: local (processes of this machine) or ray (each worker a "
                         "Ray actor's process on a node of a Ray cluster; pip install 'kiln[ray]')",
                         choices=("local", "ray")),
        "address": Field(str, "auto", "the Ray cluster to join: auto (the one `ray start` runs here), "
                         "HOST:PORT of its head (GCS), or ray://HOST:PORT (Ray client)"),
        "bind": Field(str, "", "the address workers on other nodes reach the supervisor's worker socket by "
                      "(empty: this node's address as Ray knows it)"),
        "port": Field(int, 0, "the worker socket's TCP port (0: any free one)", 0, 65535),
        "files": Field(str, "auto", "model files on the nodes: auto (a node uses the model's path when it holds a file "
                       "of that size there, else fetches a copy from the supervisor, sha256-checked) or fetch (every "
                       "node keeps its own checked copies)", choices=("auto", "fetch")),
        "node_store": Field(str, "", "where nodes keep fetched model files (empty: KILN_HOME/models/cluster, as each "
                            "node's environment says)"),
    },
}

@dataclass
class Config:
    values: dict[str, dict[str, Any]]
    sources: dict[str, str]                     # "server.port" -> "default" | "file" | "env" | "cli"
    workers: dict[str, dict[str, Any]]
    workers_source: str = "default"
    file: Path | None = None

    def __getitem__(self, section: str) -> dict[str, Any]:
        return self.values[section]

    def as_dict(self) -> dict:
        out = {sec: {k: {"value": v, "source": self.sources[f"{sec}.{k}"]} for k, v in vals.items()}
               for sec, vals in self.values.items()}
        out["workers"] = {n: {"value": w, "source": self.workers_source} for n, w in self.workers.items()}
        out["file"] = str(self.file) if self.file else None
        return out


def find_config_file(explicit: str | None) -> Path | None:
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        return p
    env = os.environ.get("KILN_CONFIG")
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise ConfigError(f"KILN_CONFIG={env}: no such file")
        return p
    for p in (Path("kiln.toml"),
              Path(os.environ.get("KILN_HOME") or Path.home() / ".kiln") / "kiln.toml"):
        if p.is_file():
            return p
    return None


def _check_models(m: dict) -> None:
    from .units import parse_duration, parse_size
    try:
        parse_duration(m["keep_alive"])
    except ValueError as e:
        raise ConfigError(f"models.keep_alive: {e}") from None
    for k in ("memory_budget", "min_available"):
        if k == "memory_budget" and m[k] == "auto":
            continue
        try:
            parse_size(m[k], 1)
        except ValueError:
            raise ConfigError(f"models.{k} = {m[k]!r} is not a size: use e.g. 8GiB, 500MB or 60%"
                              + (" or auto" if k == "memory_budget" else "")) from None


def kv_types(models: dict, settings: dict | None = None) -> tuple[str, str]:
    """The (keys, values) types of a model's KV cache: a worker's own kv_type_k / kv_type_v /
    kv_type first, then [models] kv_type_k / kv_type_v / kv_type."""
    s = settings or {}
    return (s.get("kv_type_k") or s.get("kv_type") or models["kv_type_k"] or models["kv_type"],
            s.get("kv_type_v") or s.get("kv_type") or models["kv_type_v"] or models["kv_type"])


def load_config(file: str | None = None, cli: dict[str, Any] | None = None,
                env: dict[str, str] | None = None, workers: dict | None = None) -> Config:
    """Build the effective configuration. `cli` maps "section.field" to values from flags;
    `workers`, when given, replaces the declared workers (e.g. `kiln up --model`)."""
    env = os.environ if env is None else env
    path = find_config_file(file)
    data: dict = {}
    if path:
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    unknown = set(data) - set(SCHEMA) - {"workers"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}; allowed: "
                          f"{', '.join(list(SCHEMA) + ['workers'])}")
    values: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for sec, fields in SCHEMA.items():
        table = data.get(sec, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{sec}] must be a table")
        bad = set(table) - set(fields)
        if bad:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(f'{sec}.{b}' for b in sorted(bad))}; "
                              f"allowed in [{sec}]: {', '.join(fields)}")
        values[sec] = {}
        for name, f in fields.items():
            key = f"{sec}.{name}"
            value, src = f.default, "default"
            if name in table:
                value, src = _coerce(key, f, table[name], False), "file"
            env_key = f"KILN_{sec.upper()}_{name.upper()}"
            if key == "models.kv_type" and KV_ENV_ALIAS in env and env_key not in env:
                value, src = _coerce(f"{KV_ENV_ALIAS} ({key})", f, env[KV_ENV_ALIAS].strip().lower(), True), "env"
            if env_key in env:
                value, src = _coerce(f"{env_key} ({key})", f, env[env_key], True), "env"
            if cli and key in cli and cli[key] is not None:
                value, src = _coerce(key, f, cli[key], True), "cli"
            values[sec][name], sources[key] = value, src
    for env_key in env:
        for sec, fields in SCHEMA.items():
            prefix = f"KILN_{sec.upper()}_"
            if env_key.startswith(prefix) and env_key[len(prefix):].lower() not in fields:
                raise ConfigError(f"environment variable {env_key} names no setting; "
                                  f"[{sec}] has: {', '.join(fields)}")
    _check_models(values["models"])
    if values["supervisor"]["backoff_max"] < values["supervisor"]["backoff_initial"]:
        raise ConfigError("supervisor.backoff_max must be ≥ supervisor.backoff_initial")
    if workers is not None:
        wtables, wsrc = workers, "cli"
    elif "workers" in data:
        wtables, wsrc = data["workers"], "file"
        if not isinstance(wtables, dict):
            raise ConfigError(f"{path}: [workers] must hold [workers.<name>] tables")
    else:
        wtables, wsrc = DEFAULT_WORKERS, "default"
    parsed = {}
    for name, t in wtables.items():
        w = _worker(name, t)
        n, split = w.pop("replicas"), w.pop("split")
        if split > 1:
            parsed.update(_split(name, w, split, n))
            continue
        if n > 1:
            if w["kind"] not in ("inference", "moe-stream") or w["module"]:
                raise ConfigError(f"[workers.{name}] replicas = {n}: only model workers (inference, moe-stream) "
                                  f"have copies")
            w["group"] = name
        parsed[name] = w
        for i in range(2, n + 1):           # a dot: no configured name can take a copy's
            parsed[f"{name}.{i}"] = {**w, "settings": dict(w["settings"])}
    for w in parsed.values():
        # a model worker without its own KV types runs [models]' (kiln up --kv-type, the env alias)
        if w["kind"] in ("inference", "moe-stream", "stage") and not w["module"] \
                and not any(k in w["settings"] for k in KV_SETTINGS) and kv_types(values["models"]) != ("f16", "f16"):
            w["settings"]["kv_type_k"], w["settings"]["kv_type_v"] = kv_types(values["models"])
    return Config(values, sources, parsed, wsrc, path)
