"""Which engine made a committed result file's rows: the caption every generated docs table carries.

Rows written so far carry no version, so ``docs/results/provenance.json`` records, per file, the
package version and the commit(s) that added its rows (a run appended over several commits names
the first and the last). Two kinds of note refine it where a file mixes engines:

* ``runs``: the commit each value of a row field (``field``, e.g. ``run``) was measured with;
* ``changes``: engine changes that landed while the rows were being written, at a Unix time, so a
  table can split rows written before and after one (rows carry their ``time``).

Rows written from now on carry their engine themselves (``engine``: :func:`engine_stamp`, the
version and the commit of the code that ran, ``+dirty`` with uncommitted changes), and a file
without an entry is labelled from them. Headline rows also carry ``engine_source``
(:func:`engine_source`: a hash of the engine's code, which needs no git history, so a wheel
install computes it too) and ``machine`` (:func:`machine_stamp`). ``record(file)`` writes a file's entry from ``git log``
(``python -m cacheblend_bench.doc_tables --record docs/results/NEW.jsonl``, after committing
the rows); notes are kept.
"""

from __future__ import annotations

import ast
import datetime
import functools
import hashlib
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE = "provenance.json"


@dataclass(frozen=True)
class Change:
    """An engine change that landed at ``time`` (Unix seconds) while a file's rows were written."""

    commit: str
    time: float
    what: str


@dataclass(frozen=True)
class Provenance:
    file: str
    engine: str  # the package version at those commits
    commits: tuple[str, ...]  # the commits that added the rows, oldest first
    date: str  # of the last of them
    runs: dict[str, Any] = field(default_factory=dict)  # {"field": name, "commits": {value: commit}}
    changes: tuple[Change, ...] = ()

    def label(self) -> str:
        """``cacheblend-rag 0.2.0.dev0, commit abc1234, 2026-12-03`` (a range for appended runs)."""
        at = f"commit {self.commits[0]}" if len(self.commits) == 1 else f"commits {self.commits[0]} to {self.commits[-1]}"
        return f"cacheblend-rag {self.engine}, {at}, {self.date}"

    def era(self, row: dict) -> int:
        """How many of ``changes`` had landed when ``row`` was written (0: before the first)."""
        return sum(row["time"] >= c.time for c in self.changes)


def _path(results: Path) -> Path:
    return results / FILE


def load(results: Path) -> dict[str, Provenance]:
    """Every entry of ``<results>/provenance.json``, by file name."""
    raw = json.loads(_path(results).read_text(encoding="utf-8"))
    return {
        name: Provenance(
            file=name,
            engine=e["engine"],
            commits=tuple(e["commits"]),
            date=e["date"],
            runs=e.get("runs", {}),
            changes=tuple(Change(**c) for c in e.get("changes", ())),
        )
        for name, e in raw.items()
    }


def of(results: Path, name: str) -> Provenance:
    """``name``'s entry, or one made from its rows' own ``engine`` stamps."""
    entries = load(results) if _path(results).exists() else {}
    if name in entries:
        return entries[name]
    stamped = _from_rows(results / name)
    if stamped is None:
        raise KeyError(
            f"docs/results/{name} has no entry in {FILE} and its rows carry no engine: after committing "
            f"it, run python -m cacheblend_bench.doc_tables --record docs/results/{name}"
        )
    return stamped


def _from_rows(path: Path) -> Provenance | None:
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    stamps = list(dict.fromkeys(r.get("engine") for r in rows))
    if not rows or None in stamps:
        return None
    versions = list(dict.fromkeys(s.split("+")[0] for s in stamps))
    commits = tuple(dict.fromkeys(s.split("+g", 1)[1] if "+g" in s else "unknown" for s in stamps))
    date = datetime.datetime.fromtimestamp(max(r.get("time", 0) for r in rows), datetime.timezone.utc).date().isoformat()
    return Provenance(file=path.name, engine=" and ".join(versions), commits=commits, date=date)


@functools.cache
def engine_stamp() -> str:
    """This engine: its version and, in a git checkout, the commit (``0.2.0.dev0+gabc1234``, with
    ``.dirty`` when the package has uncommitted changes). Benchmarks write it into every row."""
    import cacheblend_rag
    from cacheblend_rag import __version__

    package = Path(cacheblend_rag.__file__).resolve().parent
    try:
        commit = _git(package, "rev-parse", "--short=7", "HEAD").strip()
        dirty = bool(_git(package, "status", "--porcelain", "--", str(package)).strip())
    except (OSError, subprocess.CalledProcessError):
        return __version__
    return f"{__version__}+g{commit}" + (".dirty" if dirty else "")


# The engine's code: the module that defines CacheBlendEngine and every module of the package it
# imports, at any depth and wherever in a module the import stands (lazy imports count).


def _engine_root() -> tuple[Path, str]:
    """The installed package's folder and the module that defines ``CacheBlendEngine``."""
    import cacheblend_rag

    return Path(cacheblend_rag.__file__).resolve().parent, cacheblend_rag.CacheBlendEngine.__module__


def _module_file(package_dir: Path, name: str) -> Path | None:
    """``cacheblend_rag.a.b`` -> ``<package_dir>/a/b.py`` or ``a/b/__init__.py`` (None: not a module)."""
    parts = name.split(".")[1:]
    base = package_dir.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules ``path`` (module ``name``) imports, absolute or relative."""
    package = name.split(".")[0]
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == package}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").split(".")[0] == package:
                base = node.module
            else:
                continue
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # kept below only where a module
    return found


def engine_modules(package_dir: Path | None = None, root: str | None = None) -> dict[str, Path]:
    """The engine's modules by name: ``root`` (default: the module of ``CacheBlendEngine``) and,
    transitively, every module of its package it imports (read from the sources, nothing
    imported). The benchmarks are not the engine."""
    if package_dir is None or root is None:
        default_dir, default_root = _engine_root()
        package_dir, root = package_dir or default_dir, root or default_root
    if _module_file(package_dir, root) is None:
        raise FileNotFoundError(f"the engine's module {root} is not in {package_dir}")
    package = root.split(".")[0]
    found: dict[str, Path] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name in found or name.startswith(f"{package}.bench"):
            continue
        path = _module_file(package_dir, name)
        if path is None:
            continue
        found[name] = path
        todo += sorted(_imports(name, path))
        # A submodule's import runs its packages' __init__ first.
        todo += [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]
    return dict(sorted(found.items()))


def _normalized(source: str) -> str:
    """The code without comments, docstrings and formatting: what a reformat does not change."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def engine_source(package_dir: Path | None = None, root: str | None = None) -> str:
    """A hash of the engine's code (:func:`engine_modules`, each module's name and its code without
    comments, docstrings or formatting): 16 hex digits. Rows carry it as ``engine_source``; a row
    whose hash is not today's measured other code than today's engine."""
    h = hashlib.sha256()
    for name, path in engine_modules(package_dir, root).items():
        h.update(name.encode() + b"\0" + _normalized(path.read_text(encoding="utf-8")).encode() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def engine_source_now() -> str:
    """:func:`engine_source` of the installed package, computed once per process."""
    return engine_source()


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version (it pins the llama.cpp it builds), or None where not installed."""
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


# The CPU features that decide which kernels run (and so the timings): recorded in every row.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


@functools.cache
def machine_stamp() -> dict[str, Any]:
    """What ran a row: CPU model and the kernel-deciding flags (``/proc/cpuinfo``), the cores
    and torch's threads, torch's and llama-cpp-python's versions. Benchmarks write it into every row."""
    import os

    import torch

    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu": model,
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "llama_cpp": llama_cpp_version(),
    }


def machine_label(rows: list[dict[str, Any]]) -> str:
    """What ran ``rows``, for a table: "AMD EPYC (avx2, avx512f), 2 threads", or "not recorded"
    where a row does not say or the rows come from more than one machine."""
    machines = {(m["cpu"], tuple(m["cpu_flags"]), m["threads"]) for r in rows if (m := r.get("machine"))}
    if len(machines) != 1 or any("machine" not in r for r in rows):
        return "not recorded"
    cpu, flags, threads = machines.pop()
    return f"{cpu} ({', '.join(flags) or 'no AVX2'}), {threads} threads"


def caption(results: Path, files: tuple[str, ...]) -> str:
    """The line under a generated table: which files its rows are and which engine made them."""
    parts = [f"`docs/results/{name}` ({of(results, name).label()})" for name in files]
    return ("Rows: " if any(n.endswith(".jsonl") for n in files) else "Source: ") + "; ".join(parts) + "."


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def _version_at(root: Path, commit: str) -> str:
    for path in ("cacheblend_rag/__init__.py", "pyproject.toml"):
        try:
            text = _git(root, "show", f"{commit}:{path}")
        except subprocess.CalledProcessError:
            continue
        m = re.search(r'^(?:__version__|version)\s*=\s*"([^"]+)"', text, re.M)
        if m:
            return m.group(1)
    raise ValueError(f"no package version found at commit {commit}")


def _adding_commits(root: Path, rel: str) -> list[str]:
    """The commits whose version of ``rel`` holds the current rows, oldest first, following
    renames: a commit that replaced the file's rows (rather than appending to them) starts the
    list over, and one that left them unchanged (a rename) is not counted."""
    out = _git(root, "log", "--follow", "--format=@%h", "--name-only", "--", rel)
    history = [(block.split()[0], block.split()[-1]) for block in out.split("@")[1:]][::-1]
    if not history:
        raise ValueError(f"{rel} is not committed: commit the rows first, then record them")
    commits: list[str] = []
    previous: list[str] = []
    for c, path in history:
        lines = _git(root, "show", f"{c}:{path}").splitlines()
        if lines == previous:
            continue
        appended = bool(previous) and lines[: len(previous)] == previous and rel.endswith(".jsonl")
        commits = [*commits, c] if appended else [c]
        previous = lines
    return commits


def record(root: Path, rel: str) -> Provenance:
    """Write ``rel``'s entry (a path like ``docs/results/x.jsonl``) from git, keeping its notes."""
    results = root / "docs" / "results"
    name = Path(rel).name
    commits = _adding_commits(root, f"docs/results/{name}")
    path = _path(results)
    raw = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    entry = raw.get(name, {})
    entry.update(
        engine=_version_at(root, commits[-1]),
        commits=commits,
        date=_git(root, "show", "-s", "--format=%ad", "--date=short", commits[-1]).strip(),
    )
    raw[name] = entry
    _write(path, raw)
    return load(results)[name]


def _write(path: Path, raw: dict[str, Any]) -> None:
    """One line per file, sorted, so a new entry is a one-line diff."""
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in sorted(raw.items())]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
