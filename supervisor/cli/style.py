"""How `--help` reads. Typer ≥ 0.2x prints a type tag beside every parameter (`--json <bool>`,
`--port <int>`); for people those tags are noise — a flag takes no value, and an option's help
says what it wants. Options that take a value show an upper-case name (`--port PORT`); flags
and arguments show none."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from typer import core


def _display_type_rich(self, ctx):
    if self.metavar is not None:
        return self.metavar
    if getattr(self, "is_flag", False) or getattr(self, "count", False) or isinstance(self, core.TyperArgument):
        return None
    return (self.name or "value").upper()


core._TyperParameter.display_type_rich = _display_type_rich
core.TyperOption.display_type_rich = _display_type_rich


def _usage_display_name(self) -> str:
    """`kiln run PROMPT`, `kiln models pull [MODEL]` — not `{prompt}`."""
    name = (self.metavar or self.name or "arg").upper()
    if self.nargs != 1:
        name += "..."
    return name if self.required else f"[{name}]"


core.TyperArgument._usage_display_name = _usage_display_name

# Help texts are plain text: `hf:ORG/REPO[/FILE.gguf]` must print as written, not be parsed as
# Rich markup (it crashed `kiln models pull --help` with a MarkupError). Typer imports its Rich
# helpers only to print help or an error; importing them here cost every command 0.25 s, so the
# patch is applied when Typer imports them.


def _patch(rich_utils) -> None:
    from rich.markup import escape
    make = rich_utils._make_rich_text

    def plain(*, text: str, style: str = "", markup_mode):
        return make(text=escape(text), style=style, markup_mode=markup_mode)
    rich_utils._make_rich_text = plain


class _OnImport(importlib.abc.MetaPathFinder):
    """Patches typer.rich_utils right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "typer.rich_utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


if "typer.rich_utils" in sys.modules:
    _patch(sys.modules["typer.rich_utils"])
else:
    sys.meta_path.insert(0, _OnImport())
