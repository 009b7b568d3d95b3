"""The `kiln` command line. Daemon commands reach the supervisor over its control socket;
`kiln models` and `kiln debug` work on model files directly."""

from __future__ import annotations

import typer

from .cli_engine import debug_app, models_app

app = typer.Typer(name="kiln", no_args_is_help=True, add_completion=False,
                  help="Kiln: a local LLM runtime that keeps crash-isolated workers alive.")
app.add_typer(models_app, name="models")
app.add_typer(debug_app, name="debug")


def main() -> None:
    app()
