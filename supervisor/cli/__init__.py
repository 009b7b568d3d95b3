"""The `kiln` command line: one module per command group (`python -m kiln.supervisor.cli`; the
typer app and its entry point are in main.py)."""
