"""No code from the cache: planted pickles are never unpickled, and the package source has no
code-loading calls (pickle, unsafe torch.load, eval/exec, remote code, pickling diskcache).

The KV store directory may be shared with less trusted processes; diskcache's default ``Disk``
unpickles whatever it finds, so anyone able to write the directory could otherwise run code in
the server. The engine must treat a planted pickle as a corrupt record and recompute.
"""

from __future__ import annotations

import ast
import logging
import sys
from pathlib import Path

import diskcache
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from rel_common import CHUNKS, REPO, answer, engine, fully_decodable, keys_of


class Evil:
    """Unpickling this creates ``marker`` (stands in for arbitrary code)."""

    def __init__(self, marker: Path, tag: str = "", pad: int = 0) -> None:
        self.marker, self.tag = str(marker), tag
        self.pad = b"x" * pad  # a large pad makes diskcache keep the pickle in its own file

    def __reduce__(self):
        return (open, (self.marker, "w"))

    def __hash__(self) -> int:  # diskcache hashes keys only for FanoutCache sharding
        return hash(self.tag)


@pytest.fixture(scope="module")
def clean():
    eng = engine(None)
    eng.precompute(CHUNKS, progress=False)
    out = answer(eng, CHUNKS)
    eng.close()
    return out


def _plant(directory: Path, keys: list[str], marker: Path) -> None:
    """Pickled values and keys at the engine's chunk keys, through a default (pickling) Cache."""
    with diskcache.Cache(str(directory)) as raw:
        raw.set(f"{keys[0]}/meta", Evil(marker))  # inline pickle, read by contains()
        raw.set(f"{keys[1]}/1", Evil(marker, pad=100_000))  # file-backed pickle, read mid-prefill
        raw.set(f"{keys[2]}/0", Evil(marker), tag=keys[2])
        for key in keys:  # pickled keys next to every chunk's records
            raw.set(Evil(marker, tag=f"{key}/meta"), b"value under a pickled key", tag=key)
            raw.set((f"{key}/0", Evil(marker)), Evil(marker))


def test_planted_pickles_never_run_and_the_answer_is_clean(tmp_path, clean, caplog) -> None:
    marker = tmp_path / "pwned"
    eng = engine(tmp_path / "kv")
    try:
        eng.precompute(CHUNKS, progress=False)
        keys = keys_of(eng, CHUNKS)
        _plant(eng.store.directory, keys, marker)
        with caplog.at_level(logging.WARNING):
            got = answer(eng, CHUNKS)
        assert got[0] == clean[0] and torch.equal(got[1], clean[1])
        assert not marker.exists()
        assert eng.store.stats.corrupt == 3  # each planted value was seen and refused
        assert "refusing to unpickle" in caplog.text
        eng.flush()
        assert all(fully_decodable(eng, k) for k in keys)  # rewritten with raw records
        # Maintenance paths walk rows too: discard (tag eviction), volume, clear.
        for key in keys:
            eng.store.discard(key)
        eng.store.volume()
        eng.store.clear()
        assert not marker.exists()
    finally:
        eng.close()
    # Sanity: the planted payload is live for a reader that unpickles (the default Disk).
    with diskcache.Cache(str(tmp_path / "kv2")) as raw:
        raw.set("x", Evil(marker))
        raw.get("x")
    assert marker.exists()


def test_planted_pickles_are_culled_without_running(tmp_path) -> None:
    # LRU culling during writes deletes the planted rows (and their files) without loading them.
    marker = tmp_path / "pwned"
    with diskcache.Cache(str(tmp_path / "kv")) as raw:
        for i in range(30):
            raw.set(f"planted/{i}", Evil(marker, pad=40_000 if i % 2 else 0))
            raw.set(Evil(marker, tag=str(i)), b"v")
    eng = engine(tmp_path / "kv", size_limit=150_000)
    try:
        # Past the limit on purpose (check_room=False): the writes must cull.
        eng.precompute([f"{c} ({i})" for i in range(2) for c in CHUNKS], progress=False, check_room=False)
        with diskcache.Cache(str(tmp_path / "kv")) as raw:
            left = raw._sql("SELECT COUNT(*) FROM Cache WHERE key LIKE 'planted/%'").fetchone()[0]
        assert left < 30  # culling reached the planted rows
        assert not marker.exists()
    finally:
        eng.close()


# ------------------------------------------------------------------ source scan

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
DYNAMIC_CODE = {"eval", "exec", "compile", "__import__"}


def code_loading_calls(source: str, filename: str = "<src>") -> list[str]:
    """Every construct in ``source`` that can load code from data, as 'file:line: what'."""
    found: list[str] = []
    tree = ast.parse(source, filename)

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            flag(node, f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(func, ast.Name) and name in DYNAMIC_CODE:
                flag(node, f"{name}(...)")
            if name in {"load", "loads", "Unpickler"} and owner.split(".")[-1] in PICKLE_MODULES:
                flag(node, f"{owner}.{name}(...)")
            if owner == "torch" and name == "load":
                wo = kw.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    flag(node, "torch.load(...) without weights_only=True")
            if name in {"load", "unsafe_load", "full_load"} and owner == "yaml":
                flag(node, f"yaml.{name}(...)")
            if name == "read_pickle" or (
                name == "load" and isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value
            ):
                flag(node, f"{name}(...) of a pickle")
            rc = kw.get("trust_remote_code")
            if rc is not None and not (isinstance(rc, ast.Constant) and rc.value is False):
                flag(node, "trust_remote_code not pinned to False")
            if name in {"Cache", "FanoutCache"} and owner in {"diskcache", ""} and "diskcache" in source:
                disk = kw.get("disk")
                if not (isinstance(disk, ast.Name) and disk.id == "SafeDisk"):
                    flag(node, f"diskcache.{name} without disk=SafeDisk (pickles values)")
            if name in {"Index", "Deque"} and owner == "diskcache":
                flag(node, f"diskcache.{name} (pickles values)")
    return found


def _package_sources() -> list[Path]:
    files = sorted((REPO / "cacheblend_rag").rglob("*.py"))
    for pkg in sorted((REPO / "integrations").glob("*/*")) if (REPO / "integrations").is_dir() else []:
        if pkg.is_dir() and pkg.name != "tests":
            files += sorted(p for p in pkg.rglob("*.py") if "tests" not in p.parts)
    return files


def test_package_source_loads_no_code() -> None:
    files = _package_sources()
    assert REPO / "cacheblend_rag" / "store" / "disk.py" in files
    found = [hit for f in files for hit in code_loading_calls(f.read_text(), str(f.relative_to(REPO)))]
    assert not found, "code-loading calls in package source:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle\npickle.loads(b)",
        "from pickle import loads",
        "import torch\ntorch.load(p)",
        "import torch\ntorch.load(p, weights_only=False)",
        "x = eval(s)",
        "exec(s)",
        "m = AutoModel.from_pretrained(p, trust_remote_code=True)",
        "import diskcache\nc = diskcache.Cache(d)",
        "import yaml\nyaml.load(s)",
    ],
)
def test_the_scanner_catches_each_pattern(snippet: str) -> None:
    assert code_loading_calls(snippet), f"scanner missed: {snippet!r}"


@pytest.mark.parametrize(
    "snippet",
    [
        "model = model.eval()",  # nn.Module.eval is not builtins.eval
        "import torch\ntorch.load(p, weights_only=True)",
        "import re\nre.compile(p)",
        "import diskcache\nc = diskcache.Cache(d, disk=SafeDisk)",
    ],
)
def test_the_scanner_allows_safe_lookalikes(snippet: str) -> None:
    assert not code_loading_calls(snippet)
