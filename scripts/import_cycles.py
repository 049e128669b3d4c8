"""Fail if modules of our packages import each other in a cycle (type-only and function-level imports count).

    python scripts/import_cycles.py [PACKAGE ...]     default: memstore trainer_client
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports anywhere (top level, functions, TYPE_CHECKING blocks)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != here:
                out.add(name)
    return out


def cycles(packages: list[str]) -> list[list[str]]:
    files = [p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if not p.name.endswith("_pb2.py") and "_pb2" not in p.name]
    known = {module_name(p) for p in files}
    graph = {module_name(p): imports(p, known) for p in files}
    # A package's __init__ importing its own submodules is how packages expose names, not a cycle of logic.
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not d.startswith(mod + ".") and not mod.startswith(d + ".")}
    found: list[list[str]] = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    found = cycles(sys.argv[1:] or ["memstore", "trainer_client"])
    for comp in found:
        print("import cycle: " + " <-> ".join(comp))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
