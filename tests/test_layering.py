"""The rules the code base keeps about itself, checked by reading its source (fast tier):
imports point one way, every error code is in the shared vocabulary, no module passes 400
lines."""

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


def test_no_module_passes_400_lines():
    """Every module of the code base — the packages, bench/, tests/ and the C kernels — at most
    400 lines (issue 36): past that a file holds more than one concern; split it along its seams."""
    files = [p for d in PACKAGES + ("bench", "tests") for p in (ROOT / d).rglob("*.py")]
    files += [p for ext in ("*.c", "*.h") for p in (ROOT / "native").rglob(ext)]
    long = {str(p.relative_to(ROOT)): n for p in files
            if "build" not in p.parts and (n := len(p.read_text().splitlines())) > 400}
    assert len(files) > 100 and not long, f"split these along their seams: {long}"


# -- tiers -----------------------------------------------------------------------------------------

def _starts_a_daemon(source: str) -> bool:
    return "Daemon(" in source or '"up", "--config"' in source


def test_every_module_that_starts_a_daemon_is_in_the_e2e_tier():
    """The fast tier (`pytest -m "not e2e"`) starts no daemon: a module that does says so itself."""
    unmarked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        src = path.read_text()
        if path.name == Path(__file__).name:          # names the harness, starts nothing
            continue
        mark = re.search(r"^pytestmark = (.*)$", src, re.M)
        if _starts_a_daemon(src) and not (mark and "pytest.mark.e2e" in src[mark.start():mark.start() + 200]):
            unmarked.append(path.name)
    assert not unmarked, "these start a daemon; add `pytestmark = pytest.mark.e2e`: " + ", ".join(unmarked)


# -- the supervisor's own layers -------------------------------------------------------------------

DIALECTS = {"http.openai": "openai", "http.openai_shapes": "openai", "http.openai_validate": "openai",
            "http.openai_responses": "openai", "http.openai_responses_shapes": "openai", "http.anthropic": "anthropic", "http.ollama": "ollama",
            "http.ollama_library": "ollama", "http.llama_server": "llama-server", "http.llama_fields": "llama-server"}
# the shared validation every dialect's translation uses (OpenAI's shapes are the common ground)
SHARED = {"http.openai_validate", "http.llama_fields"}


def _module_graph(package: str = "supervisor") -> dict[str, set[str]]:
    """module ("core.router") -> the modules of the same package it imports, at any depth of the file."""
    top = ROOT / package
    modules = {".".join(p.relative_to(top).with_suffix("").parts): p for p in sorted(top.rglob("*.py"))
               if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".")[:-1]                    # the subpackage it sits in
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                if node.level - 1 > len(here):
                    continue
                stem = base + (node.module.split(".") if node.module else [])
            elif (node.module or "").startswith(f"kiln.{package}"):
                stem = node.module.split(".")[2:]
            else:
                continue
            for alias in node.names:                   # `from . import x` names modules too
                for cand in (".".join(stem + [alias.name]), ".".join(stem)):
                    if cand in modules:
                        found.add(cand)
                        break
        graph[name] = found - {name}
    return graph


def test_no_dialect_imports_another():
    graph = _module_graph()
    wrong = [f"{m} imports {t}" for m, ts in graph.items() if m in DIALECTS
             for t in ts if t in DIALECTS and DIALECTS[t] != DIALECTS[m] and t not in SHARED]
    assert not wrong, "a dialect shares only the pipeline (http/pipeline.py), never another dialect:\n" + "\n".join(wrong)


# who may import whom inside the supervisor: front ends -> bus -> core, nothing sideways
LAYERS = {"core": {"core"}, "bus": {"bus", "core"}, "http": {"http", "bus", "core"},
          "cli": {"cli", "bus", "core", "serve"}}         # `kiln up` runs what serve.py puts together


def test_the_supervisor_imports_point_from_the_front_ends_to_the_core():
    wrong = []
    for m, ts in _module_graph().items():
        layer = m.split(".")[0]
        for t in ts:
            if layer in LAYERS and t.split(".")[0] not in LAYERS[layer]:
                wrong.append(f"supervisor/{m.replace('.', '/')}.py imports {t}")
    assert not wrong, "cli and http -> bus -> core (supervisor/serve.py alone puts them together):\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_modules(package):
    cycles = _cycles(_module_graph(package))
    assert not cycles, f"modules of {package}/ that import each other (directly or round a loop): {cycles}"


def test_the_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
