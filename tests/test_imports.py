"""The package's import graph: no cycles, and the core builds on neither the benchmarks nor the
integrations.

The graph is read from the source (an AST scan), so it holds every import a module can run:
module-level ones, those inside functions (imported lazily), those under ``TYPE_CHECKING`` and
``importlib.import_module("...")`` calls with a literal name. A lazy import hides a cycle from
Python at start-up, not from a reader: each edge counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "cacheblend_rag"
# The core may not import these: benchmarks build on the core, and so do the integrations (their
# own packages, which depend on cacheblend-rag).
NOT_FROM_THE_CORE = (f"{PACKAGE}.bench", "langchain_cacheblend", "llama_index.cacheblend")
# Known cycles, each with the work that removes it.
KNOWN_CYCLES: set[frozenset[str]] = set()


def modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _literal_import(node: ast.Call) -> str | None:
    """The module a call ``importlib.import_module("x")`` / ``__import__("x")`` names, if literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name in ("import_module", "__import__") and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
            return arg.value
    return None


def imports(name: str, path: Path, known: set[str] | dict[str, Path]) -> set[str]:
    """Every module that module ``name`` (source ``path``) imports, anywhere in its source.

    ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module of ``known``, else
    ``pkg``. Importing ``a.b`` also runs ``a/__init__``; that implicit edge is not counted, or every
    module would depend on the package's façade (which imports the engine).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Call):
            literal = _literal_import(node)
            if literal:
                found.add(literal)
    found.discard(name)
    return found


def graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    mods = modules(root, package)
    return {name: {m for m in imports(name, path, mods) if m in mods} for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _describe(component: frozenset[str], edges: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(edges[m] & component))}" for m in sorted(component))


def test_the_package_has_no_import_cycles() -> None:
    edges = graph(REPO)
    assert f"{PACKAGE}.engine" in edges and f"{PACKAGE}.store.disk" in edges  # the scan found the package
    found = [c for c in cycles(edges) if c not in KNOWN_CYCLES]
    assert not found, "import cycles (make the dependency go one way):\n" + "\n".join(_describe(c, edges) for c in found)


def test_the_core_imports_neither_the_benchmarks_nor_an_integration() -> None:
    mods = modules(REPO)
    bad = []
    for name, path in mods.items():
        if name == f"{PACKAGE}.bench" or name.startswith(f"{PACKAGE}.bench."):
            continue
        for target in sorted(imports(name, path, mods)):
            if any(target == banned or target.startswith(banned + ".") for banned in NOT_FROM_THE_CORE):
                bad.append(f"{path.relative_to(REPO)} imports {target}")
    assert not bad, "the core (cacheblend_rag outside bench/) must not import these:\n" + "\n".join(bad)


# The layers above the core, each of which may import the core but never the other way round:
# the serving path every front end shares, the HTTP server, the replicas, the commands (``cli``
# and the commands it dispatches to) and the benchmarks (and the integrations, outside the package).
ABOVE_THE_CORE = tuple(
    f"{PACKAGE}.{name}" for name in ("serving", "server", "cluster", "bench", "cli", "__main__", "store_cli", "ingest")
)


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def core_arrows_up(root: Path, package: str = PACKAGE, above: tuple[str, ...] = ABOVE_THE_CORE) -> list[str]:
    """Every import from a core module (one of ``package`` outside ``above``) of a module in a
    layer above it (``above``) or of an integration."""
    mods = modules(root, package)
    banned = above + NOT_FROM_THE_CORE
    return [
        f"{name} imports {target}"
        for name, path in mods.items()
        if name != package and not _within(name, above)
        for target in sorted(imports(name, path, mods))
        if _within(target, banned)
    ]


def test_no_arrow_runs_from_the_core_up_to_serving_the_server_or_the_benchmarks() -> None:
    assert f"{PACKAGE}.serving.request" in modules(REPO) and f"{PACKAGE}.engine" in modules(REPO)
    bad = core_arrows_up(REPO)
    assert not bad, "the core must not import the layers above it (move the code down, or pass it in):\n" + "\n".join(bad)


def test_the_layer_check_catches_an_arrow_up_however_it_is_written(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "engine.py": "def stream():\n    from .serving.request import answer_settings",  # lazily, as engine.py once did
            "serving/__init__.py": "",
            "serving/request.py": "from ..engine import stream",  # down: allowed
        },
    )
    assert core_arrows_up(root, "pkg", ("pkg.serving",)) == ["pkg.engine imports pkg.serving.request"]


# ------------------------------------------------------------------ the scanner itself


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "a_imports",
    [
        "from . import b",  # module level
        "def f():\n    from .b import thing",  # lazily, in a function
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import Thing",
        "import importlib\nM = importlib.import_module('pkg.b')",
    ],
)
def test_the_scan_finds_a_cycle_however_the_import_is_written(tmp_path: Path, a_imports: str) -> None:
    root = _package(tmp_path, {"__init__.py": "", "a.py": a_imports, "b.py": "from .a import x"})
    assert cycles(graph(root, "pkg")) == [frozenset({"pkg.a", "pkg.b"})]


def test_the_scan_resolves_relative_imports_from_subpackages(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from .core import x",  # the façade: not an edge of everything below it
            "core.py": "from .sub.leaf import y",
            "sub/__init__.py": "",
            "sub/leaf.py": "from ..util import z\nfrom .. import other",
            "util.py": "",
            "other.py": "",
        },
    )
    edges = graph(root, "pkg")
    assert edges["pkg.sub.leaf"] == {"pkg.util", "pkg.other"}
    assert edges["pkg.core"] == {"pkg.sub.leaf"}
    assert cycles(edges) == []
