"""What the page modules build on: the result files read once (:class:`Results`), a generated
table (:class:`Table`) and a group of numbers quoted in prose (:class:`Values`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheblend_bench import provenance


class Results:
    """The files of one results folder, each read once, and which of them a computation read
    (``reading``): a table or group of numbers may read only the files it declares, since its
    caption names them and its cached result is keyed by their bytes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._cache: dict[tuple[str, str], Any] = {}
        self._memo_files: dict[str, set[str]] = {}
        self.read: set[str] = set()

    def _get(self, kind: str, name: str, read: Callable[[Path], Any]) -> Any:
        self.read.add(name)
        if (kind, name) not in self._cache:
            path = self.folder / name
            if not path.is_file():
                raise FileNotFoundError(f"docs/results/{name} is missing: a docs table or number is computed from it")
            self._cache[(kind, name)] = read(path)
        return self._cache[(kind, name)]

    def rows(self, *names: str) -> list[dict]:
        """The rows of one or more JSON-lines files, in order."""
        return [
            r
            for name in names
            for r in self._get(
                "rows", name, lambda p: [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
            )
        ]

    def json(self, name: str) -> Any:
        return self._get("json", name, lambda p: json.loads(p.read_text(encoding="utf-8")))

    def text(self, name: str) -> str:
        return self._get("text", name, lambda p: p.read_text(encoding="utf-8"))

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """A summary computed once per folder (several tables and numbers read the same one); the
        files it read count as read by every caller."""
        if ("memo", key) not in self._cache:
            outer, self.read = self.read, set()
            try:
                self._cache[("memo", key)] = compute()
                self._memo_files[key] = self.read
            finally:
                self.read = outer | self.read
        self.read |= self._memo_files[key]
        return self._cache[("memo", key)]

    def digest(self, files: tuple[str, ...]) -> str:
        """A hash of these files' bytes and of the provenance notes (what a cached result depends on)."""
        h = hashlib.sha256()
        for name in (*files, provenance.FILE):
            path = self.folder / name
            h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"<missing>") + b"\0")
        return h.hexdigest()


@dataclass(frozen=True)
class Table:
    """A generated table: the result files it reads and how it is drawn. ``caption`` replaces the
    default caption (the files and the engine that made them) where rows mix engines."""

    files: tuple[str, ...]
    render: Callable[[Results], str]
    caption: Callable[[Results], str] | None = None

    def block(self, results: Results) -> str:
        cap = self.caption(results) if self.caption else provenance.caption(results.folder, self.files)
        return f"{self.render(results)}\n\n{cap}\n"


@dataclass(frozen=True)
class Values:
    """Numbers quoted in prose, named ``<prefix>.<key>``: the files they come from and a function
    returning every key's value (a number, a ``fmt.Stat``, a list for a range, or a function of no
    arguments returning one, for a value that is costly to compute and quoted rarely)."""

    files: tuple[str, ...]
    compute: Callable[[Results], dict[str, Any]]
