"""`kiln ps`, `kiln activate`, `kiln models load|unload`: models at run time, from the CLI."""

from __future__ import annotations

import json
import time

import typer


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _threads(m: dict) -> str:
    """Compute threads, and why fewer than the cores: other processes keeping cores busy."""
    t, others = m.get("threads"), m.get("other_processes_cores")
    if t is None:
        return "-"
    return f"{t} (others busy: {others:.1f} cores)" if others and others >= 0.5 else str(t)


def _kv(m: dict) -> str:
    """A model's KV cache: its bytes and, when known, its types (keys/values when they differ)."""
    kinds = "/".join(dict.fromkeys(m.get("kv_types") or []))
    return _mb(m.get("kv_cache_bytes")) + (f" {kinds}" if kinds else "")


def register(app: typer.Typer, models_app: typer.Typer, command) -> None:
    @app.command()
    def ps(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
        """Loaded models: worker, state, memory (RSS, planned), KV cache use, weights (mapped or private),
        compute threads, expires-at."""
        out = command("ps")
        if as_json:
            typer.echo(json.dumps(out, indent=2))
            return
        if out.get("active_model"):
            typer.echo(f"default model: {out['active_model']} (kiln activate)")
        if out.get("budget_bytes") is not None:
            typer.echo(f"memory: {_mb(out['used_bytes'])} of a {_mb(out['budget_bytes'])} budget")
        nodes = any(m.get("node") for m in out["models"])        # workers on a cluster's nodes
        rows = [("MODEL", "WORKER", "STATE", "CONTEXT", "RSS", "PLANNED", "KV", "WEIGHTS", "THREADS", "UNTIL")
                + (("NODE",) if nodes else ())]
        for m in out["models"]:
            until = "pinned" if m.get("pinned") else "forever" if m.get("expires_at") is None and \
                m.get("keep_alive_s") is None else "-" if m.get("expires_at") is None else \
                f"{max(0, m['expires_at'] - time.time()):.0f} s"
            if m.get("unloading"):
                until = "unloading"
            rows.append((str(m["model"]), m["worker"], m["state"] + (f"/{m['worker_state']}" if m.get("worker_state") else ""),
                         f"{m['n_ctx']:,}" if m.get("n_ctx") else "-", _mb(m.get("rss_bytes")), _mb(m.get("planned_bytes")), _kv(m),
                         m.get("weights") or "-", _threads(m), until) + ((m.get("node") or "-",) if nodes else ()))
        for m in out["models"]:                   # why each context is what it is, above the table
            if m.get("n_ctx") and m.get("context_why"):
                typer.echo(f"context of {m['model']}: {m['n_ctx']:,} ({m['context_why']})")
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())

    @app.command()
    def activate(model: str = typer.Argument(..., help="a library model (name, file stem or path)")):
        """Make MODEL the default for requests that name none; kept across restarts."""
        out = command("activate", {"model": model})
        typer.echo(f"{out['active_model']} is the default model ({out['path']})")

    @models_app.command("load")
    def load(model: str = typer.Argument(..., help="a library model (name, file stem or path)")):
        """Load MODEL now, as a request naming it would (idle models may be unloaded to make room)."""
        out = command("load", {"model": model}, 60)
        typer.echo(f"loading {model} on worker {out['worker']} (`kiln ps` shows it)")

    @models_app.command("unload")
    def unload(model: str = typer.Argument(..., help="a loaded model or its worker"),
               force: bool = typer.Option(False, "--force", help="unload even while it serves requests")):
        """Unload MODEL (workers configured in kiln.toml are pinned: `kiln stop NAME` stops those)."""
        out = command("unload", {"model": model, "force": force})
        typer.echo(f"unloading {out.get('model', model)} (worker {out['worker']})")
