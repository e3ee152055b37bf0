"""The package's import graph: no module imports another that imports it back, at import time or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pulseloco

_ROOT = Path(pulseloco.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in _ROOT.rglob("*.py"):
        parts = ("pulseloco", *path.relative_to(_ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(path: Path, modules: dict[str, Path], *, top_level_only: bool) -> set[str]:
    """The package modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` if a module, else ``a.b``)."""
    tree = ast.parse(path.read_text())
    nodes = (
        ast.walk(tree)
        if not top_level_only
        else [n for s in tree.body for n in ast.walk(s) if not isinstance(s, ast.FunctionDef | ast.ClassDef)]
    )
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_circle_at_import_time() -> None:
    modules = _modules()
    edges = {name: _imports(path, modules, top_level_only=True) - {name} for name, path in modules.items()}
    assert _cycles(edges) == []


def test_no_two_modules_import_each_other() -> None:
    modules = _modules()
    edges = {name: _imports(path, modules, top_level_only=False) - {name} for name, path in modules.items()}
    mutual = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges[b]})
    assert mutual == []


def test_the_graph_sees_the_imports_it_checks() -> None:
    # a check that found no edges would pass on any package: the matchmaker's imports are there
    modules = _modules()
    edges = _imports(modules["pulseloco.loco.matchmaking"], modules, top_level_only=True)
    assert {"pulseloco.loco.consensus", "pulseloco.loco.peers", "pulseloco.keys"} <= edges
