"""The configuration and CLI references in docs/, generated from the code so that they cannot
drift from it: `python -m kiln.supervisor.cli.reference_docs` rewrites docs/configuration.md (from
the config schema) and docs/cli.md (from the typer app), and tests/test_docs.py fails when
either file differs from what this module produces now.

The output depends on nothing but the code: no terminal width, no environment, no clock —
sub-commands in name order, help text reflowed into one line per paragraph.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import typer

from . import main as cli
from ..core.config import BUILTIN_KINDS, DEFAULT_WORKERS, KIND_SETTINGS, SCHEMA, WORKER_FIELDS

COMMAND = "python -m kiln.supervisor.cli.reference_docs"
ROOT = Path(__file__).resolve().parents[2]          # the source checkout this module lives in


def _notice(source: str) -> str:
    return f"> Generated from {source} by `{COMMAND}`: edit the code and rerun it, not this file."


def _prose(text: str) -> str:
    """Markdown for plain text: outside code spans, `<`, `~` and `*` are escaped, so that
    `Bearer <key>` is not taken for an HTML tag nor `~/.kiln … ~/x` for a strikethrough."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace("~", "\\~").replace("*", "\\*")
    return "`".join(parts)


def _cell(text: str) -> str:
    """One table cell: one line, and `|` escaped everywhere (inside code spans too, as GFM needs)."""
    return _prose(" ".join(str(text).split())).replace("|", "\\|")


def _paragraphs(help_text: str | None) -> list[str]:
    """A docstring's paragraphs, each on one line (click cuts help at a form feed, so do we)."""
    text = inspect.cleandoc((help_text or "").split("\f")[0])
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def _blocks(help_text: str | None) -> list[str]:
    """The paragraphs as Markdown, a blank line after each."""
    return [line for p in _paragraphs(help_text) for line in (_prose(p), "")]


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows] + [""]


def _toml(value) -> str:
    """A value as kiln.toml spells it (what a reader copies into the file)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    return str(value)


# -- configuration ------------------------------------------------------------------------------

def _env(section: str, key: str) -> str:
    return f"KILN_{section.upper()}_{key.upper()}"      # the name config.load_config reads

def configuration_markdown() -> str:
    out = ["# Configuration reference", "", _notice("`kiln.supervisor.core.config`"), "",
           "Where a setting comes from, the last one winning: its default; `kiln.toml` (`kiln up --config "
           "FILE`, else `$KILN_CONFIG`, else `./kiln.toml`, else `$KILN_HOME/kiln.toml`); its environment "
           "variable `KILN_<SECTION>_<KEY>`; a command-line flag (`kiln up --host`, `--port`, …). Unknown "
           "sections and keys, a `KILN_<SECTION>_…` variable that names no key, and a value of the wrong "
           "type or out of range are errors that say what is allowed. `kiln config` prints every "
           "effective value and where it came from.", ""]
    out += ["Sections: " + ", ".join(f"[`[{s}]`](#{s})" for s in SCHEMA) + ", [`[workers.NAME]`](#workersname).", ""]
    for section, fields in SCHEMA.items():
        out += [f"## [{section}]", ""]
        out += _table(("key", "value", "default", "environment", "what it does"),
                      [(f"`{k}`", f.describe(), f"`{_toml(f.default)}`", f"`{_env(section, k)}`", f.help)
                       for k, f in fields.items()])
    out += ["## [workers.NAME]", "",
            "Each worker is a `[workers.NAME]` table (NAME: letters, digits, `-` and `_`), in `kiln.toml` "
            "only: workers have no environment variables. `kind` is required. Without any worker table, "
            "`kiln up` runs these:", "", "```toml"]
    for name, table in DEFAULT_WORKERS.items():
        out += [f"[workers.{name}]"] + [f"{k} = {_toml(v)}" for k, v in table.items()] + [""]
    out[-1] = "```"
    out += [""] + _table(("key", "value", "default", "what it does"),
                         [(f"`{k}`", f.describe(), "required" if f.default is None else f"`{_toml(f.default)}`", f.help)
                          for k, f in WORKER_FIELDS.items()])
    out += ["### Kinds", "", "A kind that is not built in needs a `module` (run as `python -m MODULE`).", ""]
    out += _table(("kind", "module", "settings"),
                  [(f"`{k}`", f"`{m}`", ", ".join(f"`{s}`" for s in KIND_SETTINGS.get(k, {})) or "none")
                   for k, m in BUILTIN_KINDS.items()])
    out += ["### Settings of each kind", "",
            "A worker's `settings` table is checked against what its kind reads: a misspelt key is an "
            "error that lists the allowed ones. A custom kind (one with a `module`) gets its settings "
            "unchecked. `threads` is a key of the worker's table, not a setting.", ""]
    for kind, settings in KIND_SETTINGS.items():
        out += [f"#### {kind}", ""]
        out += _table(("setting", "what it does"), [(f"`{k}`", h) for k, h in settings.items()]) if settings \
            else ["No settings.", ""]
    return "\n".join(out).rstrip() + "\n"


# -- command line -------------------------------------------------------------------------------

def _walk(cmd, path: list[str]):
    """Every visible command, depth first, sub-commands in name order (stable across versions)."""
    yield path, cmd
    for name in sorted(getattr(cmd, "commands", {})):
        sub = cmd.commands[name]
        if not getattr(sub, "hidden", False):
            yield from _walk(sub, path + [name])


def _is_argument(param) -> bool:
    return not getattr(param, "opts", [""])[0].startswith("-")


def _value(param) -> str:
    """What an option takes: "flag" for a flag, else its metavar as `--help` shows it."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return "flag"
    name = param.metavar or (param.name or "value").upper()
    return name + (", repeatable" if param.multiple else "") + (", required" if param.required else "")


def _default(param) -> str:
    d = param.default
    if d is None or callable(d) or d in ([], ()) or (getattr(param, "is_flag", False) and d is False):
        return ""
    return "on" if d is True else f"`{d}`"


def _usage(path: list[str], cmd) -> str:
    params = [p for p in cmd.params if not getattr(p, "hidden", False)]
    words = list(path) + (["[OPTIONS]"] if any(not _is_argument(p) for p in params) else [])
    for p in filter(_is_argument, params):
        name = (p.metavar or p.name).upper() + ("..." if p.nargs != 1 else "")
        words.append(name if p.required else f"[{name}]")
    return " ".join(words + (["COMMAND", "[ARGS]..."] if hasattr(cmd, "commands") else []))


def _anchor(path: list[str]) -> str:
    return "-".join(path)          # the GitHub anchor of a heading "`kiln models pull`"


def cli_markdown() -> str:
    root = typer.main.get_command(cli.app)
    commands = list(_walk(root, ["kiln"]))
    out = ["# CLI reference", "", _notice("the `kiln` typer app (`kiln.supervisor.cli.main`)"), ""]
    out += _blocks(cli.__doc__) + ["Every command also takes `--help`.", ""]
    out += [f"{'  ' * (len(p) - 2)}- [`{' '.join(p)}`](#{_anchor(p)})" for p, _ in commands[1:]] + [""]
    for path, cmd in commands:
        out += [f"{'##' if len(path) <= 2 else '###'} `{' '.join(path)}`", "", f"`{_usage(path, cmd)}`", ""]
        out += _blocks(cmd.help)
        subs = [(n, c) for n, c in sorted(getattr(cmd, "commands", {}).items()) if not getattr(c, "hidden", False)]
        if subs and len(path) > 1:
            out += _table(("command", "what it does"),
                          [(f"[`{' '.join(path + [n])}`](#{_anchor(path + [n])})", (_paragraphs(c.help) or [""])[0])
                           for n, c in subs])
        params = [p for p in cmd.params if not getattr(p, "hidden", False)]
        args = [p for p in params if _is_argument(p)]
        if args:
            out += _table(("argument", "required", "default", "what it is"),
                          [(f"`{(p.metavar or p.name).upper()}`", "yes" if p.required else "no", _default(p),
                            getattr(p, "help", None) or "") for p in args])
        opts = [p for p in params if not _is_argument(p)]
        if opts:
            out += _table(("option", "takes", "default", "what it does"),
                          [(", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts]), _value(p), _default(p),
                            getattr(p, "help", None) or "") for p in opts])
    return "\n".join(out).rstrip() + "\n"


PAGES = {"configuration.md": configuration_markdown, "cli.md": cli_markdown}


def main() -> None:
    docs = ROOT / "docs"
    if not (ROOT / "pyproject.toml").is_file():      # an installed copy has no docs/ to rewrite
        sys.exit(f"{ROOT} is not a source checkout: run `{COMMAND}` from one (pip install -e .)")
    for name, render in PAGES.items():
        (docs / name).write_text(render())
        print(f"wrote {docs / name}")


if __name__ == "__main__":
    main()
