"""The rules the code base keeps about itself, checked by reading its source (fast tier):
imports point one way, every error code is in the shared vocabulary, no supervisor module
passes 500 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kiln.protocol.vocab import ERRORS

ROOT = Path(__file__).parent.parent
PACKAGES = ("supervisor", "workers", "protocol", "native")
# what each package may import of Kiln's (ARCHITECTURE.md, "Import direction")
ALLOWED = {"supervisor": {"supervisor", "protocol", "native"}, "workers": {"workers", "protocol", "native"},
           "protocol": {"protocol"}, "native": {"native"}}


def _kiln_imports(path: Path, package: str, subpath: tuple = ()) -> list[tuple[int, str]]:
    """(line, top-level Kiln package) of every import of Kiln's in the file; `subpath`: the
    subpackage folders the file sits in below its package (relative imports resolve from there)."""
    tree = ast.parse(path.read_text(), str(path))
    here = [package, *subpath]                   # the file's package, as kiln.<here...>
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                target = base[0] if base else ((node.module or "").split(".")[0] or node.names[0].name.split(".")[0])
            elif (node.module or "").startswith("kiln."):
                target = node.module.split(".")[1]
            else:
                continue
            found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kiln."):
                    found.append((node.lineno, a.name.split(".")[1]))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, target in _kiln_imports(path, package, path.relative_to(ROOT / package).parts[:-1]):
            if target not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports kiln.{target}")
    assert not wrong, f"{package}/ may import only {sorted(ALLOWED[package])} of Kiln's:\n" + "\n".join(wrong)


def test_the_import_scan_sees_a_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from kiln.supervisor import router\nimport kiln.workers.runtime\nfrom .. import native\n"
                   "from ..blocks import x\n")
    assert [t for _, t in _kiln_imports(bad, "workers")] == ["supervisor", "workers", "native", "blocks"]
    assert [t for _, t in _kiln_imports(bad, "native", ("arch",))][2:] == ["native", "native"]


def test_every_error_code_raised_is_in_the_shared_vocabulary():
    pattern = re.compile(r'(?:OpError|CommandError|RouteError|_finish\(p,|_error\(client,)\s*\(?\s*"([a-z_]+)"')
    missing = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for code in pattern.findall(path.read_text()):
                if code not in ERRORS:
                    missing.add(f"{code} ({path.relative_to(ROOT)})")
    assert not missing, "error codes without an HTTP status in protocol/vocab.py: " + ", ".join(sorted(missing))


def test_no_supervisor_module_passes_500_lines():
    long = {p.name: n for p in (ROOT / "supervisor").glob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these along their seams: {long}"
