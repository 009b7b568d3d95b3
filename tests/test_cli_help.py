"""Every `kiln … --help` works and reads cleanly (fast tier, in-process): exit 0, no crash, a
description for every command and option, no type tags (`<str>`) or `{arg}` metavars."""

import re

import pytest
import typer
from typer.testing import CliRunner

from kiln.supervisor.cli.main import app

runner = CliRunner()


def _commands():
    out = []

    def walk(cmd, path):
        out.append(path)
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, path + [name])
    walk(typer.main.get_command(app), [])
    return out


COMMANDS = _commands()


def test_the_walk_finds_the_commands():
    names = {" ".join(p) for p in COMMANDS}
    assert {"up", "ps", "models pull", "models load", "train sft", "eval run", "chat"} <= names


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "kiln")
def test_help_is_clean(path):
    r = runner.invoke(app, [*path, "--help"], terminal_width=120)
    assert r.exit_code == 0, r.output
    out = r.output
    assert not re.search(r"<(str|int|bool|float|path)>", out), out
    assert not re.search(r"\{[a-z_]+\}", out), out
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    assert (cmd.help or "").strip(), f"kiln {' '.join(path)} has no description"
    for p in cmd.params:
        if p.name != "help":
            assert (getattr(p, "help", None) or "").strip(), f"kiln {' '.join(path)}: {p.name} has no description"


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and re.match(r"kiln \d+\.\d+", r.output), r.output
