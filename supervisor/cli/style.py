"""How `--help` reads. Typer ≥ 0.2x prints a type tag beside every parameter (`--json <bool>`,
`--port <int>`); for people those tags are noise — a flag takes no value, and an option's help
says what it wants. Options that take a value show an upper-case name (`--port PORT`); flags
and arguments show none."""

from __future__ import annotations

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
# Rich markup (it crashed `kiln models pull --help` with a MarkupError).
from rich.markup import escape  # noqa: E402
from typer import rich_utils  # noqa: E402

_make_rich_text = rich_utils._make_rich_text


def _plain_rich_text(*, text: str, style: str = "", markup_mode):
    return _make_rich_text(text=escape(text), style=style, markup_mode=markup_mode)


rich_utils._make_rich_text = _plain_rich_text
