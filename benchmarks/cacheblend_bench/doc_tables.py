"""Tables and numbers in the docs generated from the committed result files, never typed by hand.

A page holds a generated table between ``<!-- table: NAME -->`` and ``<!-- /table -->``, and a
generated number in its prose between ``<!--n:NAME SPEC-->`` and ``<!--/n-->`` (``SPEC`` says how
it is printed: ``x1`` 4.4x, ``xci2`` 4.36x [4.22, 4.51], ``pct`` 44%, ...; see
``published.fmt.render``). ``python -m cacheblend_bench.doc_tables`` rewrites every such table
and number in ``README.md`` and ``docs/*.md`` from ``docs/results``; ``--check`` only reports what
differs (the test suite runs it, so a changed row changes the page or fails the tests);
``--list`` prints every table and group of numbers with the files they come from; ``--record
FILE`` writes a newly committed result file's entry in ``docs/results/provenance.json`` (which
engine made its rows: every table's caption says).

``--check`` also holds the README's results table to the headline rule (``bench.headline``): the
rows it reads must be made in today's defaults on today's engine code. A row that is not fails the
check, naming the table, the row and the setting; cases still to be re-made (``headline.PENDING``)
are listed as "headline rows to re-make", each with the command that re-makes it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cacheblend_bench import headline, provenance
from cacheblend_bench.published import Results, fmt, registry

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
VALUE = re.compile(r"(<!--n:([\w.-]+)(?: (\w+))?-->)(.*?)(<!--/n-->)", re.S)


# Rendered tables and computed number groups, by name and the bytes of the files they read: a
# second page update in the same process (the tests run several) recomputes only what changed.
_CACHE: dict[tuple[str, str, str], Any] = {}


class Renderer:
    """Tables and numbers from one results folder, each computed once."""

    def __init__(self, root: Path = ROOT) -> None:
        self.results = Results(root / "docs" / "results")
        self.tables, self.values = registry()

    def _cached(self, kind: str, name: str, files: tuple[str, ...], compute: Callable[[], Any]) -> Any:
        key = (kind, name, self.results.digest(files))
        if key not in _CACHE:
            self.results.read = set()
            result = compute()
            undeclared = self.results.read - set(files)
            if undeclared:
                raise RuntimeError(
                    f"{kind} {name} read {sorted(undeclared)} without declaring them in its files "
                    f"{list(files)}: add them, so its caption and cache cover them"
                )
            _CACHE[key] = result
        return _CACHE[key]

    def table(self, name: str) -> str:
        if name not in self.tables:
            raise KeyError(f"table marker names {name!r}; known tables: {', '.join(sorted(self.tables))}")
        table = self.tables[name]
        return self._cached("table", name, table.files, lambda: table.block(self.results))

    def value(self, name: str, spec: str | None) -> str:
        prefix, _, key = name.partition(".")
        if prefix not in self.values:
            raise KeyError(f"number marker names {name!r}; known groups: {', '.join(sorted(self.values))}")
        group = self.values[prefix]
        values = self._cached("numbers", prefix, group.files, lambda: group.compute(self.results))
        if key not in values:
            near = sorted(k for k in values if k.split(".")[0] == key.split(".")[0]) or sorted(values)
            raise KeyError(f"number marker names {name!r}, which {prefix} does not have; it has e.g. {', '.join(near[:12])}")
        if callable(values[key]):  # computed on first use, then kept
            values[key] = self._cached("number", name, group.files, values[key])
        return fmt.render(values[key], spec)

    def page(self, text: str) -> tuple[str, list[str]]:
        """The page with every block and number regenerated, and the names of those that changed."""
        stale: list[str] = []

        def block(m: re.Match) -> str:
            new = self.table(m.group(2))
            if new != m.group(3):
                stale.append(f"table {m.group(2)}")
            return m.group(1) + new + m.group(4)

        def value(m: re.Match) -> str:
            new = self.value(m.group(2), m.group(3))
            if new != m.group(4):
                stale.append(f"number {m.group(2)}: {m.group(4)!r} -> {new!r}")
            return m.group(1) + new + m.group(5)

        return VALUE.sub(value, BLOCK.sub(block, text)), stale


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def update(root: Path = ROOT, write: bool = True) -> list[str]:
    """Regenerate every table block and number; returns "page: what" for each that was out of date."""
    renderer = Renderer(root)
    stale = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        new, changed = renderer.page(text)
        stale += [f"{page.relative_to(root)}: {item}" for item in changed]
        if write and new != text:
            page.write_text(new, encoding="utf-8")
    return stale


def headline_verdict(root: Path = ROOT) -> headline.Verdict:
    """The headline rule over ``root``'s result files: failures, and the cases still to re-make."""
    return headline.check(root / "docs" / "results")


def listing() -> str:
    """Every table and group of numbers with the result files it reads (the inventory)."""
    tables, values = registry()
    lines = [f"table {name}: {', '.join(t.files)}" for name, t in sorted(tables.items())]
    lines += [f"numbers {prefix}.*: {', '.join(v.files)}" for prefix, v in sorted(values.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cacheblend_bench.doc_tables",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table or number is out of date")
    parser.add_argument("--list", action="store_true", help="print every table and group of numbers with its files")
    parser.add_argument("--record", metavar="FILE", help="write FILE's entry (a committed docs/results file) in provenance.json")
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if args.record:
        print(f"{args.record}: {provenance.record(ROOT, args.record).label()}")
        return 0
    stale = update(write=not args.check)
    for item in stale:
        print(("out of date: " if args.check else "rewrote: ") + item)
    verdict = headline_verdict()
    if verdict.pending:
        print("headline rows to re-make:\n" + "\n".join(f"  {line}" for line in verdict.pending))
    for item in verdict.failures:
        print(f"headline rule: {item}")
    return 1 if args.check and (stale or verdict.failures) else 0


if __name__ == "__main__":
    raise SystemExit(main())
