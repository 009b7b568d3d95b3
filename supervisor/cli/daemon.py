"""`kiln up` and `kiln down`: starting the daemon (in the foreground or detached, with its
preflight checks and log file) and stopping it; and how every daemon command reaches it."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from typing import Optional

import typer

from .engine import fail, note, verbosity


def _paths():
    from ..core.paths import Paths
    return Paths.from_env()


def _client(timeout: float = 15.0):
    from ..bus.client import ControlClient, DaemonNotRunning
    try:
        return ControlClient(_paths(), timeout)
    except DaemonNotRunning as e:
        fail(str(e))


def _command(name: str, args: dict | None = None, timeout: float = 15.0):
    from ..bus.client import CommandFailed
    with _client(timeout) as c:
        try:
            return c.command(name, args or {}, timeout)
        except CommandFailed as e:
            fail(e.message)
        except TimeoutError as e:
            fail(str(e))


def _load_config(config: Optional[str], cli: dict, workers: dict | None = None):
    from ..core.config import ConfigError, load_config
    try:
        return load_config(config, cli, workers=workers)
    except ConfigError as e:
        fail(f"configuration error: {e}", 2)


def _tuned_expert_cache(home, model: str) -> str:
    """--expert-cache auto: the size measured for this model before, or measured now."""
    from kiln.native.gguf_file import GGUFError
    from kiln.native.models.library import ModelNotFound, resolve_model
    from kiln.native.models.tune import load_tuned, save_tuned, tune
    try:
        path = resolve_model(model)
    except ModelNotFound as e:
        fail(str(e))
    tuned = load_tuned(home, path)
    if tuned is None:
        note(f"--expert-cache auto: measuring {path.name} with expert caches of several sizes "
             f"(once; kept in {home}/expert-cache-tuning.json)")
        try:
            tuned = tune(path, progress=lambda m: note(f"  {m}"))
        except (GGUFError, ValueError) as e:
            fail(str(e))
        save_tuned(home, path, tuned)
    note(f"--expert-cache auto: {tuned['suggested_bytes'] // 2**20} MiB ({tuned['rule']})")
    return f"{tuned['suggested_bytes'] // 2**20}MiB"


def _already_up(paths, pid: int) -> None:
    """`kiln up --detach` without options while the daemon runs: say where it is (exit 0), so
    the README's first command can be run again. Options might differ from the running
    daemon's, so `up` with any of them is still refused."""
    from ..bus.client import ControlClient
    try:
        with ControlClient(paths, 5) as c:
            http = c.command("status", timeout=5)["daemon"]["http"]
    except Exception as e:  # noqa: BLE001 - running but not answering: say so, as a failure
        fail(f"kiln is already running (pid {pid}) but does not answer ({e}); `kiln down` stops it")
    typer.echo(f"kiln is already up (pid {pid}); http://{http[0]}:{http[1]}; log {paths.daemon_log}")


def up(detach: bool = typer.Option(False, "--detach", "-d", help="run in the background (pidfile + log file)"),
       config: Optional[str] = typer.Option(None, "--config", "-c", help="kiln.toml to use"),
       host: Optional[str] = typer.Option(None, "--host", help="HTTP address (server.host)"),
       port: Optional[int] = typer.Option(None, "--port", help="HTTP port (server.port)"),
       insecure_no_key: bool = typer.Option(False, "--insecure-no-key", help="serve beyond loopback (--host) "
                                            "without server.api_key: anyone who reaches the port can use and stop "
                                            "Kiln (server.insecure_no_key)"),
       model: Optional[str] = typer.Option(None, "--model", "-m",
                                           help="serve this model (path, name or 'default') instead of the configured workers"),
       stream: bool = typer.Option(False, "--stream", help="stream the model's MoE experts from disk (moe-stream worker)"),
       expert_cache: str = typer.Option("25%", "--expert-cache", help="expert cache size with --stream: 512MiB, 2GiB, "
                                        "% of RAM, or auto (the size `kiln models plan M --stream` measured; "
                                        "measured now if it never was)"),
       weights: Optional[str] = typer.Option(None, "--weights", help="with --model: mapped (default: the file's page "
                                             "cache, shared) or private (copied into huge pages: faster decode "
                                             "where the page cache holds 4 KiB pages)"),
       kv_type: Optional[str] = typer.Option(None, "--kv-type", help="the KV cache of every model without its own: "
                                             "f16 (default), q8_0 or q4_0 — about 1/2 or 1/4 of the memory, so a "
                                             "longer context fits ([models] kv_type; OLLAMA_KV_CACHE_TYPE)"),
       served_model_id: Optional[str] = typer.Option(None, "--served-model-id", help="with --model: the name "
                                                     "/v1/models shows for it and clients send (default: default)"),
       only_model: bool = typer.Option(False, "--only-model", help="with --model: serve only it (no trainer or "
                                       "evaluator), as `kiln serve` does"),
       cluster: Optional[str] = typer.Option(None, "--cluster", help="run the workers on a Ray cluster: auto (the "
                                             "one `ray start` runs here) or its head's HOST:PORT ([cluster] "
                                             "backend = ray, address); see docs/cluster.md")):
    """Start the daemon: the supervisor, its workers and the HTTP API."""
    from ..bus.client import daemon_pid
    from ..core.run_files import AlreadyRunning
    from ..serve import make_supervisor
    paths = _paths()
    cli = {"server.host": host, "server.port": port, "server.insecure_no_key": insecure_no_key or None,
           "models.kv_type": kv_type.strip().lower() if kv_type else None,
           "cluster.backend": "ray" if cluster else None, "cluster.address": cluster}
    if stream and not model:
        fail("--stream needs --model", 2)
    if weights is not None and not model:
        fail("--weights needs --model (for configured workers, set weights in their settings)", 2)
    if only_model and not model:
        fail("--only-model needs --model", 2)
    if served_model_id is not None and not model:
        fail("--served-model-id needs --model (a configured worker is served under its own name)", 2)
    name = served_model_id if served_model_id is not None else "default"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}", name) or name in ("trainer", "evaluator"):
        fail(f"--served-model-id {name!r}: a name of letters, digits and . _ : / - (not trainer or evaluator)", 2)
    from ..core.config import WEIGHTS
    if weights is not None and weights not in WEIGHTS:
        fail(f"--weights {weights!r}: must be {' or '.join(WEIGHTS)}", 2)
    own = {"weights": weights} if weights is not None else {}
    if stream and expert_cache.strip().lower() == "auto":
        expert_cache = _tuned_expert_cache(paths.home, model)
    elif stream:
        from ..core.units import parse_size
        try:
            parse_size(expert_cache, 1)
        except ValueError as e:
            fail(f"--expert-cache: {e}", 2)
    workers = ({name: {"kind": "moe-stream", "model": model, "settings": {"expert_cache": expert_cache, **own}}}
               if stream else {name: {"kind": "inference", "model": model, "settings": own},
                               **({} if only_model else {"trainer": {"kind": "trainer", "model": model},
                                                         "evaluator": {"kind": "evaluator"}})}) if model else None
    cfg = _load_config(config, cli, workers)
    running = daemon_pid(paths)
    if running:
        if detach and not any((config, host, port, model, stream, weights, insecure_no_key, kv_type, served_model_id,
                               cluster)):
            _already_up(paths, running)       # as `systemctl start`: the command's goal holds already
            return
        fail(f"kiln is already running (pid {running}); `kiln down` stops it")
    from ..core.addresses import check_bind
    unsafe = check_bind(cfg["server"])
    if unsafe:
        fail(unsafe, 2)
    _preflight(cfg, paths.home)
    if detach:
        paths.ensure()
        args = [sys.executable, "-m", "kiln.supervisor.cli", "up"]
        for flag, val in (("--config", config), ("--host", host), ("--port", port), ("--model", model),
                          ("--expert-cache", expert_cache if stream else None), ("--weights", weights),
                          ("--kv-type", kv_type), ("--served-model-id", served_model_id), ("--cluster", cluster)):
            if val is not None:
                args += [flag, str(val)]
        if stream:
            args.append("--stream")
        if insecure_no_key:
            args.append("--insecure-no-key")
        if only_model:
            args.append("--only-model")
        with open(paths.daemon_log, "ab") as logf:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=os.getcwd())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = paths.daemon_log.read_text(errors="replace").strip().splitlines()[-5:]
                fail("the daemon exited at start:\n  " + "\n  ".join(tail))
            if daemon_pid(paths) == proc.pid and (paths.run / "control.sock").exists():
                from ..bus.client import ControlClient
                try:
                    with ControlClient(paths, 2) as c:
                        http = c.command("status", timeout=2)["daemon"]["http"]
                    typer.echo(f"kiln is up (pid {proc.pid}); http://{http[0]}:{http[1]}; log {paths.daemon_log}")
                    return
                except Exception:  # noqa: BLE001 - not ready yet: keep waiting
                    pass
            time.sleep(0.1)
        fail(f"the daemon (pid {proc.pid}) did not become ready within 30 s; see {paths.daemon_log}")
    v = verbosity()
    logging.basicConfig(level={-1: logging.WARNING, 0: logging.INFO}.get(v, logging.DEBUG),
                        format="%(asctime)s kiln %(message)s", stream=sys.stderr)
    logging.getLogger("kiln.frames").setLevel(logging.DEBUG if v >= 2 else logging.INFO)
    _log_to_file(paths)
    try:
        from setproctitle import setproctitle
        setproctitle("kiln: supervisor")
    except ImportError:
        pass
    sup = make_supervisor(cfg, paths)
    try:
        sup.serve(on_ready=lambda: note(
            f"kiln is up (pid {os.getpid()}); http://{sup.http_address[0]}:{sup.http_address[1]}"))
    except AlreadyRunning as e:
        fail(f"{e}; `kiln down` stops it")
    except OSError as e:
        hint = " (is another server on that port? set --port or server.port)" if e.errno == 98 else ""
        fail(f"cannot start: {e}{hint}")


def _log_to_file(paths) -> None:
    """The daemon's log goes to logs/kiln.log too (what `kiln logs kiln` reads), unless stderr
    already is that file (`kiln up --detach` sends it there)."""
    paths.ensure()
    try:
        same = os.path.samestat(os.fstat(2), os.stat(paths.daemon_log))
    except OSError:
        same = False
    if not same:
        h = logging.FileHandler(paths.daemon_log)
        h.setFormatter(logging.Formatter("%(asctime)s kiln %(message)s"))
        logging.getLogger().addHandler(h)


def _preflight(cfg, home) -> None:
    """Refuse a model that cannot run here, with the plan's numbers, before starting anything;
    route an MoE model whose experts do not fit (verdict `streams`) to a moe-stream worker.
    `kiln up --model M --stream`: M must be an MoE model whose expert cache can be sized."""
    from kiln.native.gguf_file import GGUFError
    from kiln.native.models.library import ModelNotFound, resolve_model
    from kiln.native.models.plan import plan

    from ..core.placer import worker_kv
    for name, spec in cfg.workers.items():
        if spec["kind"] == "moe-stream" and cfg.workers_source == "cli":
            from ..core.segments import size_cache
            try:
                size_cache(home, name, spec, lambda *a: None)
            except (ModelNotFound, GGUFError, ValueError, OSError) as e:
                fail(f"cannot stream {spec['model']}: {e}")
            continue
        if spec["kind"] != "inference" or not spec.get("enabled", True):
            continue
        try:
            path = resolve_model(spec["model"])
            budget = cfg["supervisor"]["memory_budget"] or None
            settings = spec.get("settings") or {}
            draft = resolve_model(settings["draft_model"]) if settings.get("draft_model") else None
            p = plan(path, settings.get("ctx"), available=budget, parallel=settings.get("parallel"), draft=draft,
                     kv=worker_kv(settings))
        except (ModelNotFound, GGUFError, ValueError, KeyError) as e:
            if cfg.workers_source == "cli":   # `kiln up --model BAD`: nothing else to serve
                fail(f"cannot serve {spec['model']}: {e}")
            continue                  # a configured worker reports it (exit 3 → fatal with the reason)
        if p["verdict"] == "too_large":
            fail(f"worker {name}: model {path.name} will not run here: {p['advice']} (`kiln models plan` has the numbers)")
        if p["verdict"] == "streams":
            cache = f"{p['expert_cache_bytes'] // 2**20}MiB"
            note(f"kiln: worker {name}: the experts of {path.name} do not fit in memory; streaming them "
                 f"from disk with a {cache} expert cache (moe-stream)")
            spec.update(kind="moe-stream", settings={**(spec.get("settings") or {}), "expert_cache": cache})


def down(timeout: float = typer.Option(30.0, "--timeout", help="seconds to wait for the daemon to exit "
                                                                  "(after the requests in flight finished)"),
         now: bool = typer.Option(False, "--now", help="cut the requests in flight instead of letting them "
                                                        "finish (supervisor.drain_timeout)")):
    """Stop the daemon gracefully: new requests are refused, the ones in flight finish (up to
    supervisor.drain_timeout), then the workers stop (shutdown → SIGTERM → SIGKILL)."""
    from ..bus.client import daemon_pid
    paths = _paths()
    pid = daemon_pid(paths)
    res = _command("shutdown", {"reason": "kiln down", **({"drain": 0} if now else {})})
    pid = res.get("pid", pid)
    if res.get("draining"):
        note(f"kiln: waiting up to {res['drain_s']:g} s for {res['draining']} request(s) in flight to finish "
             f"(`kiln down --now` cuts them)")
    deadline = time.monotonic() + timeout + res.get("drain_s", 0)
    while time.monotonic() < deadline:
        # gone means the process too, not only its pidfile: a `kiln up` right after must not
        # find the old daemon still holding the socket
        if daemon_pid(paths) is None and not _alive(pid):
            typer.echo(f"kiln stopped (pid {pid})")
            return
        time.sleep(0.05)
    fail(f"the daemon (pid {pid}) is still running after {timeout:g} s; see {paths.daemon_log}")


def _alive(pid) -> bool:
    """Whether process `pid` still runs (a zombie waiting for its parent has stopped)."""
    import psutil
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False




def serve(model: Optional[str] = typer.Argument(None, help="a GGUF file, a library name or 'default' (default: "
                                                "KILN_MODEL_PATH when it names a file, else the default model)"),
          served_model_id: Optional[str] = typer.Option(None, "--served-model-id", help="the name /v1/models shows "
                                                        "and clients send (default: default)"),
          host: Optional[str] = typer.Option(None, "--host", help="HTTP address (server.host)"),
          port: Optional[int] = typer.Option(None, "--port", help="HTTP port (server.port)"),
          kv_type: Optional[str] = typer.Option(None, "--kv-type", help="f16 (default), q8_0 or q4_0"),
          config: Optional[str] = typer.Option(None, "--config", "-c", help="kiln.toml for everything else")):
    """Serve one model in the foreground, as llama-server does: the HTTP API and that model's
    inference worker (no trainer or evaluator) until Ctrl-C."""
    if model is None:
        env = os.environ.get("KILN_MODEL_PATH", "")
        model = env if env and os.path.isfile(env) else "default"
    up(detach=False, config=config, host=host, port=port, insecure_no_key=False, model=model, stream=False,
       expert_cache="25%", weights=None, kv_type=kv_type, served_model_id=served_model_id, only_model=True,
       cluster=None)


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(serve)
    app.command()(down)
