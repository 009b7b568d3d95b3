"""The `kiln` command line. Daemon commands reach the supervisor over its control socket;
`kiln models` and `kiln debug` work on model files directly.

Exit codes: 0 ok · 1 failed, or no daemon · 2 bad configuration or arguments.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Optional

import typer

from kiln.protocol import vocab

from . import style as cli_style  # noqa: F401  (help without type tags; must precede the commands)

from . import chat as cli_chat
from . import agents as cli_agents, models as cli_models
from . import daemon as daemon_commands
from .daemon import _command, _load_config, _paths
from .debug import debug_app, eval_app
from .engine import fail, models_app
from .adapters import adapters_app
from .train import train_app
from .hf import hf_app
from .openenv import openenv_app
from . import openenv_runs as cli_openenv_runs  # noqa: F401,E402  (adds the daemon-owned run commands)
from . import eval as cli_eval  # noqa: F401,E402  (adds its commands to `kiln eval`)
from . import quantize as cli_quantize  # noqa: F401,E402  (adds `kiln models quantize`)
from . import retrieval as cli_retrieval

app = typer.Typer(name="kiln", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Kiln: a local LLM runtime that keeps crash-isolated workers alive.")
app.add_typer(models_app, name="models")
app.add_typer(debug_app, name="debug")
app.add_typer(eval_app, name="eval")
app.add_typer(train_app, name="train")
train_app.add_typer(hf_app, name="hf")
app.add_typer(adapters_app, name="adapters")
app.add_typer(openenv_app, name="openenv")
app.command("embed")(cli_retrieval.embed)
app.command("rerank")(cli_retrieval.rerank)
def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version
        try:
            typer.echo(f"kiln {version('kiln')}")
        except PackageNotFoundError:
            typer.echo("kiln (not installed: run from a source tree)")
        raise typer.Exit()


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="print Kiln's version and exit"),
          verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="more detail: with `up`, -v logs "
                                      "every request's routing (admitted, answered, retried), -vv every worker "
                                      "message too"),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="results and errors only: no progress or notes "
                                     "on stderr; with `up`, the daemon logs warnings only")):
    """Kiln: a local LLM runtime that keeps crash-isolated workers alive."""
    if verbose and quiet:
        fail("-v and -q contradict each other: give one", 2)
    if verbose or quiet:          # kept in the environment: a detached daemon inherits it
        os.environ["KILN_VERBOSITY"] = str(-1 if quiet else min(verbose, 2))
    # what Kiln writes (sessions, training data, results, logs) is the user's alone
    os.umask(0o077)


app.command("run")(cli_chat.run)
app.command("chat")(cli_chat.chat)


cli_models.register(app, models_app, lambda name, args=None, timeout=15.0: _command(name, args, timeout))
cli_agents.register(app)
daemon_commands.register(app)


def _fmt_exit(e: dict | None) -> str:
    if not e:
        return "-"
    s = f"signal {e['signal']}" if e.get("signal") else f"code {e.get('code')}"
    return s + (f" ({e['reason']})" if e.get("reason") else "")


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
           watch: bool = typer.Option(False, "--watch", "-w", help="then follow the daemon's events (worker "
                                      "started, exited, fatal, requests retried…) until Ctrl-C")):
    """Every worker: state, pid, uptime, restarts, last exit, memory, CPU."""
    st = _command("status")
    if watch:
        return _watch(st, as_json)
    if as_json:
        typer.echo(json.dumps(st))
        return
    d = st["daemon"]
    typer.echo(f"kiln pid {d['pid']}, up {d['uptime_s']:.0f} s, http://{d['http'][0]}:{d['http'][1]}")
    cl = st.get("cluster") or {}
    if cl.get("backend") == "ray":
        typer.echo(f"Ray cluster {cl['address']}: {len(cl['nodes'])} node(s) alive; workers connect to "
                   f"{cl['endpoint']} (CURVE; {cl['refused_keys']} unknown key(s) refused)")
    nodes = any(w.get("node") for w in st["workers"])
    typer.echo(f"{'NAME':<16}{'KIND':<12}{'STATE':<10}{'PID':>8}{'UPTIME':>9}{'RESTARTS':>9}{'RSS MiB':>9}{'CPU%':>7}  "
               + ("NODE               " if nodes else "") + "LAST EXIT / REASON")
    for w in st["workers"]:
        up_s = f"{w['uptime_s']:.0f}s" if w["uptime_s"] is not None else "-"
        rss = f"{w['rss_bytes'] / 2**20:.0f}" if w["rss_bytes"] else "-"
        cpu = f"{w['cpu_percent']:.0f}" if w["cpu_percent"] is not None else "-"
        state = w["state"] + (f"/{w['worker_state']}" if w["worker_state"] and w["state"] == "running"
                              and w["worker_state"] != "ready" else "")
        extra = w["reason"] if w["state"] in (vocab.FATAL, vocab.BACKOFF, vocab.STOPPED) and w["reason"] else _fmt_exit(w["last_exit"])
        node = f"{w.get('node') or '-':<19}" if nodes else ""
        typer.echo(f"{w['name']:<16}{w['kind']:<12}{state:<10}{w['pid'] or '-':>8}{up_s:>9}{w['restarts']:>9}{rss:>9}{cpu:>7}  "
                   f"{node}{extra}")


def _watch(st: dict, as_json: bool) -> None:
    """Print the status once, then every event as it happens (the daemon's event stream)."""
    from ..bus.client import ControlClient, DaemonNotRunning
    from ..core.paths import Paths
    if not as_json:
        typer.echo(f"{len(st['workers'])} workers: " + ", ".join(f"{w['name']} {w['state']}" for w in st["workers"]))
    after = max([e["seq"] for e in st["events"]], default=0)
    try:
        with ControlClient(Paths.from_env(), 45) as c:
            while True:
                got = c.command("events", {"after": after, "wait": 30}, 45)
                for e in got["events"]:
                    if as_json:
                        typer.echo(json.dumps(e))
                    else:
                        when = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
                        typer.echo(f"{when} {(e['worker'] or 'kiln'):<12} {e['event']:<18} {e['detail']}")
                after = got["last"]
    except KeyboardInterrupt:
        pass
    except (DaemonNotRunning, TimeoutError):
        fail("the daemon stopped")


@app.command()
def health(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """ok, degraded or unavailable, and why; protocol error counts; system memory, CPU, load and
    disk. Exits 1 unless ok."""
    h = _command("health")
    if as_json:
        typer.echo(json.dumps(h))
    else:
        typer.echo(h["status"] + "".join(f"\n  - {r}" for r in h["reasons"]))
        s = h["system"]
        typer.echo(f"  RAM {s['ram_available_bytes'] / 2**30:.1f} of {s['ram_total_bytes'] / 2**30:.1f} GiB available; "
                   f"{s['cpu_count']} CPUs; load {' '.join(f'{x:.2f}' for x in s['load_avg'])}")
        typer.echo(f"  protocol: {h['protocol']['bad_frames_total']} bad frames dropped {h['protocol']['bad_frames'] or ''}")
    if h["status"] != "ok":
        raise typer.Exit(1)


@app.command()
def restart(name: str = typer.Argument(..., help="worker name, or 'all'")):
    """Restart a worker (also revives a fatal one)."""
    _command("restart", {"name": name})
    typer.echo(f"restarting {name}")


@app.command()
def stop(name: str = typer.Argument(..., help="worker name, or 'all'")):
    """Stop a worker until `kiln start`."""
    _command("stop", {"name": name})
    typer.echo(f"stopping {name}")


@app.command()
def start(name: str = typer.Argument(..., help="worker name, or 'all'")):
    """Start a stopped or fatal worker."""
    _command("start", {"name": name})
    typer.echo(f"starting {name}")


@app.command()
def logs(name: str = typer.Argument(..., help="worker name, or 'kiln' for the daemon's log"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
         lines: int = typer.Option(50, "-n", help="how many lines to show")):
    """Show a worker's log (stdout and stderr)."""
    paths = _paths()
    path = paths.daemon_log if name in ("kiln", "daemon") else paths.worker_log(name)
    if not path.exists():
        known = sorted(p.name[len("worker-"):-4] for p in paths.logs.glob("worker-*.log")) if paths.logs.exists() else []
        fail(f"no log for {name!r} at {path} (logs exist for: {', '.join(known) or 'none'})")
    with open(path, "rb") as f:
        tail = f.read().decode(errors="replace").splitlines()[-lines:] if lines > 0 else []
        for ln in tail:
            typer.echo(ln)
        while follow:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            else:
                time.sleep(0.2)


def _running_config():
    """(the running daemon's settings, its HTTP address) or ({}, None) when none runs."""
    from ..bus.client import CommandFailed, ControlClient, DaemonNotRunning
    try:
        with ControlClient(_paths(), 5) as c:
            return c.command("config", {}, 5), c.command("status", {"events": 1}, 5)["daemon"]["http"]
    except (DaemonNotRunning, CommandFailed, TimeoutError, OSError):
        return {}, None


@app.command("config")
def config_cmd(file: Optional[str] = typer.Option(None, "--file", help="kiln.toml to read"),
               as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Every effective setting and where it came from (default, file, env, cli) — and, when a
    daemon is running, every setting it runs with that differs (it read them at its start)."""
    cfg = _load_config(file, {})
    d = cfg.as_dict()
    running, http = _running_config()
    diff = {f"{sec}.{k}": running[sec][k] for sec, vals in d.items() if sec not in ("file", "workers")
            for k, v in vals.items() if sec in running and k in running[sec]
            and running[sec][k]["value"] != v["value"]}
    if as_json:
        typer.echo(json.dumps({**d, "running_differs": diff, "running_http": http}))
        return
    typer.echo(f"# file: {d['file'] or '(none)'}")
    if http:
        typer.echo(f"# a daemon is running, serving http://{http[0]}:{http[1]}"
                   + (f"; {len(diff)} of its settings differ from these (restart it to apply)" if diff else ""))
    for sec, vals in d.items():
        if sec in ("file", "workers"):
            continue
        typer.echo(f"[{sec}]")
        for k, v in vals.items():
            note = ""
            if f"{sec}.{k}" in diff:
                r = diff[f"{sec}.{k}"]
                note = f" — the running daemon uses {json.dumps(r['value'])} ({r['source']})"
            typer.echo(f"  {k} = {json.dumps(v['value'])}    # {v['source']}{note}")
    for n, w in d["workers"].items():
        typer.echo(f"[workers.{n}]    # {w['source']}")
        for k, v in w["value"].items():
            typer.echo(f"  {k} = {json.dumps(v)}")


def main() -> None:
    # Ctrl-C and `kill` work whatever signal mask the parent left us (some CI runners block them)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    # ...and whatever disposition: a shell's background job starts with SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler — Ctrl-C (or `kill -INT`) would do nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    app()


if __name__ == "__main__":
    main()
