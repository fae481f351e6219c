"""The import graph of src/triton_mla_sparse, read from the source (ast; nothing is imported):
no cycle between its modules, and no module outside cli/ importing cli/ (the command is built
on the library, never the other way round).

Every import counts, also one inside a function (a lazy import still ties the two modules
together). ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to
``pkg``. Imports through importlib (a string) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "triton_mla_sparse"
SRC = Path(__file__).resolve().parents[1] / "src"
CLI = f"{PACKAGE}.cli"

# Known cycles, each broken at one edge, and only these (none today). The test fails when an edge
# listed here no longer exists, so that the entry goes with it.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def modules(src: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package __init__)."""
    found = {}
    for path in (src / package).rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return found


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its source)."""
    mods = modules(src, package)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {known(a.name) for a in node.names if a.name.split(".")[0] == package}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != package:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    edges.add(sub if sub in mods else known(target))
        graph[name] = {e for e in edges if e is not None and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]], cli: str) -> list[tuple[str, str]]:
    inside = lambda m: m == cli or m.startswith(cli + ".")  # noqa: E731
    return sorted((m, t) for m, ts in graph.items() if not inside(m) for t in ts if inside(t))


def test_no_import_cycle():
    graph = import_graph(SRC, PACKAGE)
    stale = sorted(e for e in KNOWN_CYCLE_EDGES if e[1] not in graph.get(e[0], set()))
    assert not stale, f"known cycle edges no longer in the source, remove them: {stale}"
    pruned = {m: {t for t in ts if (m, t) not in KNOWN_CYCLE_EDGES} for m, ts in graph.items()}
    found = cycles(pruned)
    detail = [
        " <-> ".join(c) + ": " + "; ".join(f"{m} -> {sorted(set(pruned[m]) & set(c))}" for m in c)
        for c in found
    ]
    assert not found, "import cycles:\n" + "\n".join(detail)


def test_library_never_imports_the_cli():
    assert upward_imports(import_graph(SRC, PACKAGE), CLI) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """On a made-up package: a cycle through a lazy relative import and a parent package, and
    an upward import of its cli, are found; a graph without them is clean."""
    pkg = tmp_path / "pkg"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "ops").mkdir()
    files = {
        "__init__.py": "from .ops import a\n",
        "ops/__init__.py": "",
        "ops/a.py": "def f():\n    from . import b\n",
        "ops/b.py": "import pkg.ops.c\n",
        "ops/c.py": "from ..ops.a import f\n",
        "lib.py": "from .cli.common import table\n",
        "cli/__init__.py": "",
        "cli/common.py": "from pkg import lib\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.ops.a"] == {"pkg.ops.b"} and graph["pkg"] == {"pkg.ops.a"}
    assert sorted(cycles(graph)) == [
        ["pkg.cli.common", "pkg.lib"],
        ["pkg.ops.a", "pkg.ops.b", "pkg.ops.c"],
    ]
    assert upward_imports(graph, "pkg.cli") == [("pkg.lib", "pkg.cli.common")]
    (pkg / "ops/c.py").write_text("")
    (pkg / "lib.py").write_text("")
    clean = import_graph(tmp_path, "pkg")
    assert cycles(clean) == [] and upward_imports(clean, "pkg.cli") == []
