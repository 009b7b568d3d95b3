"""`kiln pi-setup`, `kiln opencode-setup` and `kiln sessions`: coding agents pointed at Kiln,
and the chat sessions `kiln chat --session` saves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .engine import fail

sessions_app = typer.Typer(help="Saved chat sessions (kiln chat --session NAME).", no_args_is_help=True)


def _served(url: Optional[str]) -> tuple[str, list[dict], str]:
    """(base URL, models with their context, API key) — from the running daemon when there is
    one, else from the configuration and the library."""
    from kiln.native.models.library import library_files

    from ..bus.client import CommandFailed, ControlClient, DaemonNotRunning
    from ..core.config import ConfigError, load_config
    from ..core.paths import Paths
    try:
        cfg = load_config(None)
    except ConfigError as e:
        fail(f"configuration error: {e}", 2)
    key = cfg["server"]["api_key"]
    models: list[dict] = []
    try:
        with ControlClient(Paths.from_env(), 5) as c:
            st = c.command("status", {"events": 1}, 5)
            http = st["daemon"]["http"]
            for w in st["workers"]:
                if w["kind"] in ("inference", "moe-stream"):
                    models.append({"id": w["name"], "n_ctx": (w.get("stats") or {}).get("n_ctx")})
            lib = c.command("library", {}, 5)["models"]
            url = url or f"http://{http[0]}:{http[1]}"
    except (DaemonNotRunning, CommandFailed, TimeoutError, OSError):
        lib = [{"name": p.stem} for p in library_files()]
        url = url or f"http://{cfg['server']['host']}:{cfg['server']['port']}"
        models.append({"id": "default"})
    have = {m["id"] for m in models}
    models += [{"id": m["name"]} for m in lib if m["name"] not in have]
    return url, models, key


def register(app: typer.Typer) -> None:
    @app.command("pi-setup")
    def pi_setup(url: Optional[str] = typer.Option(None, "--url", help="Kiln's address (default: the running "
                                                   "daemon's, else the configured host and port); /v1 is appended"),
                 model: Optional[str] = typer.Option(None, "--model", help="pi's default model (default: the first "
                                                     "served)")):
        """Point the pi coding agent at Kiln: a `kiln` provider in ~/.pi/agent/models.json, and
        defaultProvider/defaultModel in settings.json — other keys kept, both files backed up."""
        from .agent_setup import setup_pi
        out = _setup(setup_pi, url, model)
        typer.echo(f"pi now uses Kiln at {out['base_url']} (default model {out['default_model']})")
        for k in ("models", "settings"):
            typer.echo(f"  wrote {out[k]}" + (f" (backup {out[k + '_backup']})" if out[k + "_backup"] else ""))

    @app.command("opencode-setup")
    def opencode_setup(url: Optional[str] = typer.Option(None, "--url", help="Kiln's address; /v1 is appended"),
                       model: Optional[str] = typer.Option(None, "--model", help="opencode's model (default: the "
                                                           "first served)")):
        """Point opencode at Kiln: an @ai-sdk/openai-compatible `kiln` provider in
        ~/.config/opencode/opencode.json — other keys kept, the file backed up."""
        from .agent_setup import setup_opencode
        out = _setup(setup_opencode, url, model)
        typer.echo(f"opencode now uses Kiln at {out['base_url']} (model kiln/{out['default_model']})")
        typer.echo(f"  wrote {out['config']}" + (f" (backup {out['backup']})" if out["backup"] else ""))

    app.add_typer(sessions_app, name="sessions")


def _setup(setup, url: Optional[str], model: Optional[str]) -> dict:
    """Run an agent's setup against what Kiln serves at `url`; a SetupError ends the command."""
    from .agent_setup import SetupError
    base, models, key = _served(url)
    try:
        return setup(Path.home(), base, models, model or models[0]["id"], key)
    except SetupError as e:
        fail(str(e))


def _store():
    from ..core.paths import Paths
    from ..core.sessions import Sessions
    return Sessions(Paths.from_env().home)


@sessions_app.command("list")
def sessions_list(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Saved sessions: name, model, turns, last update."""
    import time
    rows = _store().list()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no sessions yet (kiln chat --session NAME)")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["updated"])) if r.get("updated") else "-"
        typer.echo(f"{r['name']:<24} {r.get('model') or '-':<20} {r.get('turns', 0):>4} turns  {when}")


@sessions_app.command("show")
def sessions_show(name: str = typer.Argument(..., help="the session's name"),
                  as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Print a session's messages."""
    from ..core.sessions import SessionError
    try:
        doc = _store().load(name)
    except SessionError as e:
        fail(str(e))
    if doc is None:
        fail(f"no session named {name!r} (`kiln sessions list` shows them)")
    if as_json:
        typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
        return
    typer.echo(f"# {name}: model {doc.get('model')}, adapter {doc.get('adapter') or 'none'}")
    for m in doc["messages"]:
        typer.echo(f"{m['role']}: {m.get('content', '')}")


@sessions_app.command("rm")
def sessions_rm(name: str = typer.Argument(..., help="the session's name")):
    """Delete a session."""
    from ..core.sessions import SessionError
    try:
        _store().remove(name)
    except SessionError as e:
        fail(str(e))
    typer.echo(f"removed session {name}")


@sessions_app.command("export")
def sessions_export(name: str = typer.Argument(..., help="the session's name")):
    """The conversation as a JSONL line for `kiln train sft` ({"messages": [...]})."""
    from ..core.sessions import SessionError
    try:
        typer.echo(_store().export_line(name))
    except SessionError as e:
        fail(str(e))
