"""The structure rules of our packages, checked in CI (``./dev test``); prints each violation, exits 1 if any.

- no import cycle among modules (type-only and function-level imports count);
- the store daemon's tiers (``memstore.server``, ``memstore.spill``) never import ``trainer_client`` or
  ``memstore.interop`` (the bridges to it): they meet other code at ports, not at its formats;
- Ray is imported only inside ``memstore.ray`` (the ``[ray]`` extra): the store and the client run without it;
- ``prometheus_client`` is imported only by ``memstore.server.metrics``: the engine reports events through
  ``memstore.server.events`` and never depends on the metrics library;
- no hand-written module over 800 lines (generated ``*_pb2*`` files excepted);
- no multiple inheritance and no mixins in ``memstore.server``: the engine's parts collaborate through their
  constructors, so no class there has two bases or inherits from another class of the package (errors, Protocol,
  Enum, NamedTuple, TypedDict, the generated gRPC servicers and the event hooks ``ENGINE_HOOKS`` excepted);
- nothing but the command line's own modules and ``memstore.__main__`` imports ``memstore.cli`` (:func:`cli_imports`),
  and no two pieces under a root import each other, even through different modules (:func:`package_cycles`);
- no cross-module private imports (:func:`private_imports`);
- the trainer side imports only the store's contract from ``memstore`` (:func:`trainer_imports`);
- the product (``memstore``, ``trainer_client``: what the wheel ships) never imports the lab in ``tools/``, the tests,
  the benchmarks, the scripts or the examples, which run from a checkout (:func:`lab_imports`).

    python scripts/check_structure.py
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of ``path``'s syntax tree (``ast.walk`` order): each rule walks the same files, parsed once."""
    return _nodes_of(path.read_text())


@functools.cache
def _nodes_of(text: str) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(text)))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports anywhere (top level, functions, TYPE_CHECKING blocks)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: set[str] = set()
    for node in nodes(path):
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


PRODUCT = ("memstore", "trainer_client")  # what the wheel ships
PACKAGES = [*PRODUCT, "tools"]  # every rule but lab_imports covers the lab too
MAX_LINES = 800
FORBIDDEN = {  # importer prefix -> imported prefixes it must not use
    "memstore.server": ("trainer_client", "memstore.interop"),
    "memstore.spill": ("trainer_client", "memstore.interop"),
}


def source_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name]


def graph_of(files: list[Path]) -> dict[str, set[str]]:
    known = {module_name(p) for p in files}
    return {module_name(p): imports(p, known) for p in files}


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{mod} imports {dep} (the store's tiers meet other code at ports, not at its modules)"
        for mod, deps in sorted(graph.items())
        for prefix, banned in FORBIDDEN.items()
        if mod == prefix or mod.startswith(prefix + ".")
        for dep in sorted(deps)
        if any(dep == b or dep.startswith(b + ".") for b in banned)
    ]


CLI = "memstore.cli"
CLI_USERS = ("memstore.__main__",)  # besides the CLI's own modules: the entry point


def cli_imports(graph: dict[str, set[str]]) -> list[str]:
    """Nothing below the command line imports it: the CLI is the top floor (``memstore.__main__`` excepted)."""
    return [
        f"{mod} imports {dep}: only the command line's own modules and memstore.__main__ may (it is the top floor)"
        for mod, deps in sorted(graph.items())
        if not (mod == CLI or mod.startswith(CLI + ".") or mod in CLI_USERS)
        for dep in sorted(deps)
        if dep == CLI or dep.startswith(CLI + ".")
    ]


def package_of(mod: str) -> str:
    """The top-level piece of ours a module belongs to: ``memstore.server`` for ``memstore.server.store``, the module
    itself for one directly under a root (``memstore.config``), and the root for the root's ``__init__``."""
    return ".".join(mod.split(".")[:2])


def package_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Cycles between the pieces under each root (``memstore.spill`` importing ``memstore.config`` while the config
    imports ``memstore.spill``): every import runs one way, down the floors. A root's ``__init__`` (the public surface
    that re-exports its pieces) is left out."""
    roots = set(PACKAGES)
    collapsed: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        here = package_of(mod)
        if here in roots:
            continue
        collapsed.setdefault(here, set()).update(d for d in map(package_of, deps) if d != here and d not in roots)
    for deps in collapsed.values():
        for d in deps:
            collapsed.setdefault(d, set())
    return ["imports run both ways between " + " and ".join(comp) + ": one of them must not import the other" for comp in cycles(collapsed)]


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in ``path`` (``ray`` for ``from ray.train import x``)."""
    out: set[str] = set()
    for node in nodes(path):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


ONLY_IN = {  # third-party package -> the only package (or module) of ours that may import it, and why
    "ray": ("memstore.ray", "it is an optional extra"),
    "lightning": ("trainer_client.lightning", "it is an optional extra"),
    "torchtitan": ("trainer_client.torchtitan", "it is an optional extra"),
    "prometheus_client": ("memstore.server.metrics", "the engine reports through memstore.server.events"),
}


def misplaced_imports(files: list[Path]) -> list[str]:
    return [
        f"{module_name(p)} imports {pkg}: only {ONLY_IN[pkg][0]} may ({ONLY_IN[pkg][1]})"
        for p in files
        for pkg in sorted(third_party_imports(p) & set(ONLY_IN))
        if not (module_name(p) == ONLY_IN[pkg][0] or module_name(p).startswith(ONLY_IN[pkg][0] + "."))
    ]


def oversized(files: list[Path]) -> list[str]:
    sizes = {p: len(p.read_text().splitlines()) for p in files}
    too_long = [(p, n) for p, n in sorted(sizes.items()) if n > MAX_LINES]
    return [f"{p.relative_to(ROOT)} has {n} lines (at most {MAX_LINES}): split it by responsibility" for p, n in too_long]


ENGINE = "memstore/server"  # where classes compose instead of inheriting
EXEMPT_BASES = {"Exception", "Protocol", "Generic", "Enum", "IntEnum", "StrEnum", "Flag", "NamedTuple", "TypedDict"}
ENGINE_HOOKS = {"StoreEvents": "the engine's no-op event hooks, which the metrics override"}


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        return _base_name(node.value)
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ast.unparse(node)


def _exempt_base(node: ast.expr) -> bool:
    name = _base_name(node)
    generated = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id.endswith("_grpc")
    return generated or name in EXEMPT_BASES or name.endswith(("Error", "Exception"))


def inheritance(files: list[Path]) -> list[str]:
    """Classes of ``memstore.server`` that inherit from more than one base, from a mixin, or from another class of the package."""
    engine = [p for p in files if p.relative_to(ROOT).as_posix().startswith(ENGINE + "/")]
    trees = {p: nodes(p) for p in engine}
    ours = {n.name for t in trees.values() for n in t if isinstance(n, ast.ClassDef)}
    problems = []
    for p, tree in trees.items():
        for cls in (n for n in tree if isinstance(n, ast.ClassDef)):
            where, names = f"{module_name(p)}.{cls.name}", [_base_name(b) for b in cls.bases]
            if not all(map(_exempt_base, cls.bases[1:])):  # a second base is only ever Protocol, Generic and the like
                problems.append(f"{where} has {len(names)} bases ({', '.join(names)}): no multiple inheritance in {ENGINE}, compose")
                continue
            if "mixin" in cls.name.lower():
                problems.append(f"{where} is a mixin: give it the object it needs in its constructor")
            for base, name in zip(cls.bases, names, strict=True):
                if "Protocol" not in names and name in ours and name not in ENGINE_HOOKS and not _exempt_base(base):
                    problems.append(f"{where} inherits from {name}, a class of {ENGINE}: give it the object it needs in its constructor")
    return problems


FIRST_PARTY = ("memstore", "trainer_client", "tools", "benchmarks", "examples")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imported(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) for every import in ``path``, relative ones resolved; ``name`` is "" for ``import x.y``."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: list[tuple[int, str, str]] = []
    for node in nodes(path):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(node.lineno, base, a.name) for a in node.names]
    return out


PRIVATE_FIX = "give it a public name in a module whose job it is"


def private_imports(files: list[Path]) -> list[str]:
    """Imports of an underscore-named module or name of ours from another module.

    A leading underscore says "only this module uses it"; a second module importing it makes the name part of
    an interface nobody declared, so give it a public name in a module whose job it is (a subpackage's
    ``__init__`` can say the whole subpackage is internal). Covers ``memstore``, ``trainer_client``,
    ``tools``, ``benchmarks`` and ``examples``; tests may reach into privates. Private names of other libraries (torch's
    ``_StorageInfo``, which DCP's file layout needs; ``ray._private``) are outside this rule: not ours to rename.
    """
    problems = []
    for path in files:
        for line, module, name in _imported(path):
            if module.split(".")[0] not in FIRST_PARTY:
                continue
            full = f"{module}.{name}" if name else module
            bad = [part for part in full.split(".") if _private(part)]
            if bad and full != module_name(path):
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {full} ({bad[0]} is private: {PRIVATE_FIX})")
    return problems


TRAINER_MAY_IMPORT = ("memstore.v1", "memstore.core", "memstore.errors")


def trainer_imports(files: list[Path]) -> list[str]:
    """``trainer_client`` imports from the ``memstore`` package only its contract: ``memstore.v1`` and ``memstore.core``.

    The trainer side talks to stores through the wire contract and the pure core, never through the server, the
    spill tier, the CLI or their config. One exception: ``memstore.errors``, the package's one error table, a leaf
    module of exception classes that ``memstore.v1`` and ``memstore.core`` themselves raise (``ConfigError`` from
    ``memstore.v1.security``, ``DataChannelError`` and ``StreamError`` from the data channel and streams); the client
    catches those types, and splitting the table would give the package two.
    """
    problems = []
    for path in files:
        if module_name(path).split(".")[0] != "trainer_client":
            continue
        for line, module, name in _imported(path):
            full = f"{module}.{name}" if module == "memstore" and name else module
            if full.split(".")[0] != "memstore":
                continue
            if not any(full == ok or full.startswith(ok + ".") for ok in TRAINER_MAY_IMPORT):
                problems.append(
                    f"{path.relative_to(ROOT)}:{line}: imports {full}{f' ({name})' if name and full == module else ''}: "
                    f"trainer_client may import only {', '.join(TRAINER_MAY_IMPORT)} from memstore"
                )
    return problems


CHECKOUT_ONLY = ("tools", "tests", "benchmarks", "scripts", "examples")  # top-level packages of the repository the wheel leaves out


def lab_imports(files: list[Path]) -> list[str]:
    """Imports of a checkout-only package (:data:`CHECKOUT_ONLY`) by a module of the product, which an installed wheel
    could not satisfy: what the product runs (``memstore demo``, ``LocalCluster``) lives in the product."""
    return [
        f"{path.relative_to(ROOT)}:{line}: imports {module}: the wheel ships {' and '.join(PRODUCT)} only; "
        f"{module.split('.')[0]}/ stays in the checkout"
        for path in files
        if module_name(path).split(".")[0] in PRODUCT
        for line, module, _ in _imported(path)
        if module.split(".")[0] in CHECKOUT_ONLY
    ]


def private_import_files() -> list[Path]:
    return [p for pkg in FIRST_PARTY if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    graph = dict(graph)
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
    files = source_files()
    graph = graph_of(files)
    problems = ["import cycle: " + " <-> ".join(comp) for comp in cycles(graph)] + forbidden_imports(graph) + cli_imports(graph)
    problems += package_cycles(graph)
    problems += misplaced_imports(files) + oversized(files)
    problems += inheritance(files)
    problems += private_imports(private_import_files()) + trainer_imports(files) + lab_imports(files)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
