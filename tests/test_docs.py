"""The docs people navigate, checked by reading them (fast tier, no daemon): the generated
configuration and CLI references are what their generator makes from the code now, the README
stays short, every relative link in README.md and docs/*.md reaches a file — and a heading when it
names one — and every docs page is linked from the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from kiln.supervisor.cli import reference_docs
from kiln.supervisor.cli.main import app
from kiln.supervisor.core.config import KIND_SETTINGS, SCHEMA, WORKER_FIELDS, load_config

pytestmark = []          # fast tier: reads files, starts nothing

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
REGENERATE = "python -m kiln.supervisor.cli.reference_docs"

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+).*?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped but '-' and '_', spaces → '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2 … as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        a = github_anchor(heading)
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def links(markdown: str) -> list[str]:
    """Link and image targets outside code (a `[x](y)` in a code block is an example, not a link)."""
    return LINK.findall(CODE_SPAN.sub("", FENCE.sub("", markdown)))


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page.read_text()):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):       # http:, https:, mailto: — not ours
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: ({target}) — no file {dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            bad.append(f"{page.name}: ({target}) — {dest.name} has no heading #{fragment}")
    return bad


# -- generated references ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(reference_docs.PAGES))
def test_the_generated_reference_is_what_the_code_makes_now(name):
    on_disk = (DOCS / name).read_text() if (DOCS / name).exists() else ""
    assert on_disk == reference_docs.PAGES[name](), \
        f"docs/{name} is out of date with the code: run `{REGENERATE}` and commit the result"


def test_the_configuration_reference_names_every_key_with_its_environment_variable():
    text = reference_docs.configuration_markdown()
    for section, fields in SCHEMA.items():
        assert f"## [{section}]" in text
        for key, field in fields.items():
            row = next((line for line in text.splitlines() if line.startswith(f"| `{key}` |")
                        and f"`KILN_{section.upper()}_{key.upper()}`" in line), None)
            assert row, f"no row for {section}.{key} with KILN_{section.upper()}_{key.upper()}"
            assert reference_docs._cell(field.describe()) in row
    for key in WORKER_FIELDS:
        assert f"| `{key}` |" in text
    for kind, settings in KIND_SETTINGS.items():
        assert f"#### {kind}" in text
        assert all(f"| `{s}` |" in text for s in settings)


def test_the_documented_environment_variables_are_the_ones_the_configuration_reads():
    for section, fields in SCHEMA.items():
        for key, field in fields.items():
            text = str(field.default).lower() if isinstance(field.default, bool) else str(field.default)
            config = load_config(env={f"KILN_{section.upper()}_{key.upper()}": text})
            assert config.sources[f"{section}.{key}"] == "env", f"KILN_{section.upper()}_{key.upper()} is not read"


def test_the_cli_reference_has_every_command_and_option():
    text = reference_docs.cli_markdown()

    def walk(cmd, path):
        assert re.search(rf"^#+ `{' '.join(path)}`$", text, re.M), f"no section for {' '.join(path)}"
        for p in cmd.params:
            for opt in p.opts if p.opts[0].startswith("-") else []:
                assert f"`{opt}`" in text, f"{' '.join(path)}: option {opt} missing"
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, path + [name])
    walk(typer.main.get_command(app), ["kiln"])


def test_the_cli_reference_does_not_depend_on_the_terminal_width(monkeypatch):
    outputs = set()
    for columns in ("40", "250"):
        monkeypatch.setenv("COLUMNS", columns)
        outputs.add(reference_docs.cli_markdown())
    assert len(outputs) == 1


# -- the README and the links between pages --------------------------------------------------------

def test_the_readme_is_at_most_300_lines():
    n = len(README.read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines: move detail into a docs/ page and link it"


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = ROOT / ".ci" / "run"
    if not ci.exists():
        pytest.skip("no .ci/run in this checkout")
    command = ci.read_text().strip().splitlines()[-1]
    assert f"```bash\n{command}\n```" in README.read_text(), ".ci/run must run exactly the README's test command"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README.read_text())}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def test_the_pictures_are_shown_on_their_pages():
    assert "(dashboard.png)" in (DOCS / "operations.md").read_text()
    assert "(moe_stream.png)" in (DOCS / "models.md").read_text()


# -- the checks themselves can fail ------------------------------------------------------------------

def test_github_anchors_drop_punctuation_and_join_words_with_dashes():
    assert github_anchor("Code completion: filling in the middle") == "code-completion-filling-in-the-middle"
    assert github_anchor("`kiln models pull`") == "kiln-models-pull"
    assert github_anchor("llama-server's knobs") == "llama-servers-knobs"
    assert github_anchor("[workers.NAME]") == "workersname"
    assert github_anchor("keep_alive") == "keep_alive"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n\n## Some part\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#some-part) [ok](#here) [web](https://example.org/x)\n"
                    "[gone](missing.md) [no heading](there.md#other-part) `[code](not-a-link.md)`\n"
                    "```\n[example](nowhere.md)\n```\n\n## Here\n")
    bad = broken_links(page)
    assert len(bad) == 2, bad
    assert "missing.md" in bad[0] and "#other-part" in bad[1]


def test_the_eval_suite_in_the_docs_loads_and_scores():
    """The example suite of docs/training.md is a valid suite whose scorers judge as the table
    says (issue 42: the scorer format had to be read from the code)."""
    import json
    import re
    from kiln.native.scoring import load_suite, score
    text = (ROOT / "docs" / "training.md").read_text()
    block = re.search(r"```json\n(.*?)```", text, re.S).group(1)
    suite = load_suite(json.loads(block))
    ex = suite.examples
    assert score("Paris", ex[0], suite.default_scorer).outcome == "pass"
    assert score("It is 42.", ex[1], ex[1]["scorer"]).outcome == "pass"
    assert score("Answer: Tokyo", ex[2], ex[2]["scorer"]).outcome == "pass"
    assert score("Answer: Kyoto", ex[2], ex[2]["scorer"]).outcome == "fail"
    for kind in ("exact_match", "contains", "regex", "numeric_tolerance", "multiple_choice", "json_validity", "all"):
        assert f"| `{kind}`" in text, kind

