"""The package's import graph: no cycles, layers that import only downwards, and nothing of the
benchmarks or the integrations (which build on the package).

The graph is read from the source (an AST scan), so it holds every import a module can run:
module-level ones, those inside functions (imported lazily), those under ``TYPE_CHECKING`` and
``importlib.import_module("...")`` calls with a literal name. A lazy import hides a cycle from
Python at start-up, not from a reader: each edge counts.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "cacheblend_rag"
# The package may not import these: the benchmarks build on it, and so do the integrations (their
# own packages, which depend on cacheblend-rag).
NOT_FROM_THE_PACKAGE = ("cacheblend_bench", "langchain_cacheblend", "llama_index.cacheblend")
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


def test_the_package_imports_neither_the_benchmarks_nor_an_integration() -> None:
    mods = modules(REPO)
    bad = [
        f"{path.relative_to(REPO)} imports {target}"
        for name, path in mods.items()
        if name not in SHIMS
        for target in sorted(imports(name, path, mods))
        if any(target == banned or target.startswith(banned + ".") for banned in NOT_FROM_THE_PACKAGE)
    ]
    assert not bad, "cacheblend_rag must not import these (they build on it):\n" + "\n".join(bad)


# The layers, lowest first: each folder of the package may import the folders below it and the
# top-level modules (""), never one above it or a peer in its own tuple. Each folder's docstring
# says the same in words ("May import: ..."); the README's "Layout" draws it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("",),
    ("store",),
    ("model",),
    ("decode",),
    ("chat",),
    ("neighbours",),
    ("blend", "control"),
    ("engine",),
    ("serving",),
    ("server",),
    ("cluster",),
    ("cli",),
)
# Modules above every layer: the package's façade, ``python -m``, the tiny test models (which build
# an engine) and the deprecated aliases of modules that moved.
SHIMS = {f"{PACKAGE}.controller", f"{PACKAGE}.bench"}
ON_TOP = {PACKAGE, f"{PACKAGE}.__main__", f"{PACKAGE}.testing"} | SHIMS


def layer(module: str, root: Path = REPO) -> str:
    """The folder a module of the package lies in; "" for a top-level module."""
    parts = module.split(".")
    return parts[1] if (root / "/".join(parts[:2])).is_dir() else ""


def arrows_up(edges: dict[str, set[str]], root: Path = REPO, layers=LAYERS) -> list[str]:
    """Every import from a module to one in a higher layer or a peer folder."""
    rank = {folder: i for i, folders in enumerate(layers) for folder in folders}
    bad = []
    for source, targets in sorted(edges.items()):
        if source in ON_TOP or "." not in source:
            continue
        here = layer(source, root)
        for target in sorted(targets):
            if target in ON_TOP or "." not in target:  # the façade, the test models, an alias: above every layer
                if here != layers[-1][0]:
                    bad.append(f"{source} ({here or 'top level'}) imports {target}, which is above every layer")
                continue
            there = layer(target, root)
            if there == here:
                continue
            if here not in rank or there not in rank:
                bad.append(f"{source} -> {target}: a folder not in LAYERS (give it its place)")
            elif rank[there] >= rank[here]:
                bad.append(f"{source} ({here or 'top level'}) imports {target} ({there or 'top level'})")
    return bad


def test_every_folder_of_the_package_has_a_layer() -> None:
    folders = {p.name for p in (REPO / PACKAGE).iterdir() if (p / "__init__.py").exists()}
    listed = {f for fs in LAYERS for f in fs} - {""}
    assert folders == listed, f"LAYERS and the package's folders differ: {sorted(folders ^ listed)}"


def test_no_layer_imports_one_above_it_or_a_peer() -> None:
    bad = arrows_up(graph(REPO))
    assert not bad, "imports from a lower layer to a higher one or a peer (move the code down, or pass it in):\n" + "\n".join(bad)


def test_the_layer_check_catches_an_arrow_up_however_it_is_written(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/core.py": "def stream():\n    from ..serving.request import request_settings",  # lazily
            "serving/__init__.py": "",
            "serving/request.py": "from ..engine.core import stream",  # down: allowed
            "blend/__init__.py": "",
            "blend/fusor.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.control import c",
            "control/__init__.py": "",
            "control/c.py": "",
            "config.py": "import importlib\nM = importlib.import_module('pkg.engine.core')",
        },
    )
    layers = (("",), ("blend", "control"), ("engine",), ("serving",))
    assert arrows_up(graph(root, "pkg"), root, layers) == [
        "pkg.blend.fusor (blend) imports pkg.control.c (control)",
        "pkg.config (top level) imports pkg.engine.core (engine)",
        "pkg.engine.core (engine) imports pkg.serving.request (serving)",
    ]


@pytest.mark.parametrize("folder", sorted({f for fs in LAYERS for f in fs} - {""}))
def test_each_folder_says_what_it_owns_and_may_import(folder: str) -> None:
    text = (REPO / PACKAGE / folder / "__init__.py").read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert "May import:" in doc, f"{PACKAGE}/{folder}/__init__.py's docstring must say what the folder may import"


def test_no_module_of_the_package_is_over_500_lines() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in modules(REPO).values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 500
    }
    assert not long, f"modules over 500 lines (split them by concern): {long}"


def test_the_benchmarks_are_released_with_the_package() -> None:
    import cacheblend_rag

    text = (REPO / "benchmarks" / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^version = "(.+)"', text, re.M).group(1) == cacheblend_rag.__version__


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


@pytest.mark.parametrize(
    ("statement", "moved_to"),
    [
        ("from cacheblend_rag.controller import LoadingController as X", "cacheblend_rag.control"),
        ("from cacheblend_rag.bench import BenchConfig as X", "cacheblend_bench"),
        ("from cacheblend_rag.bench.qwen import QWEN_05B as X", "cacheblend_bench"),
    ],
)
def test_a_documented_import_that_moved_still_works_and_warns(statement: str, moved_to: str) -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    {statement}\n"
        "print(X is not None, [str(w.message) for w in caught if w.category is DeprecationWarning])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.startswith("True"), out
    assert moved_to in out.split("[", 1)[1], f"no DeprecationWarning naming {moved_to}: {out}"
