"""The source layout as a newcomer meets it: the README's layout table names every module of the
package (and nothing that is gone), and every logger is named after its module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "cacheblend_rag"
# Loggers still named by hand, each with the work that renames it.
KNOWN_LOGGER_NAMES: set[str] = set()


def layout_table(readme: str) -> list[str]:
    """The first cells of the table under the README's "## Layout" heading."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]


def listed_paths(cells: list[str]) -> set[str]:
    """Paths named in the cells: ``cacheblend_rag/x/a.py`` in full, and after it ``b.py`` for the
    same folder (``cacheblend_rag/x/b.py``)."""
    found = set()
    for cell in cells:
        folder = ""
        for name in re.findall(r"`([^`]+)`", cell):
            if name.startswith(("cacheblend_rag/", "integrations/", "benchmarks/")):
                folder = name if name.endswith("/") else name.rsplit("/", 1)[0] + "/"
                found.add(name)
            else:
                assert folder, f"{name!r} in the layout table's cell {cell.strip()!r} follows no full path"
                found.add(folder + name)
    return found


def package_modules() -> set[str]:
    sources = [*PACKAGE.rglob("*.py"), *(REPO / "benchmarks" / "cacheblend_bench").rglob("*.py")]
    return {str(p.relative_to(REPO)) for p in sources if p.name != "__init__.py"}


def test_the_readme_layout_table_lists_every_module():
    listed = listed_paths(layout_table((REPO / "README.md").read_text(encoding="utf-8")))
    missing = sorted(package_modules() - listed)
    assert not missing, "modules missing from the README's layout table (## Layout): " + ", ".join(missing)
    gone = sorted(p for p in listed if not (REPO / p).exists())
    assert not gone, "the README's layout table names files that do not exist: " + ", ".join(gone)


def test_the_layout_reader_resolves_short_names_against_the_cell_path():
    cells = layout_table(
        "# x\n\n## Layout\n\n| file | concept |\n| --- | --- |\n"
        "| `cacheblend_rag/store/keys.py`, `dtypes.py` | keys |\n| `cacheblend_rag/rope.py` | rope |\n"
        "\n## Next\n\n| `cacheblend_rag/other.py` | not in the layout |\n"
    )
    assert listed_paths(cells) == {"cacheblend_rag/store/keys.py", "cacheblend_rag/store/dtypes.py", "cacheblend_rag/rope.py"}


def hand_named_loggers(source: str) -> list[str]:
    """``logging.getLogger(...)`` calls whose name is not ``__name__``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "getLogger"
            and node.args
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__")
        ):
            found.append(f"line {node.lineno}: getLogger({ast.unparse(node.args[0])})")
    return found


def test_every_logger_is_named_after_its_module():
    sources = sorted(PACKAGE.rglob("*.py")) + sorted(
        p for p in (REPO / "integrations").rglob("*.py") if "tests" not in p.relative_to(REPO).parts
    )
    bad = [
        f"{path.relative_to(REPO)} {hit}"
        for path in sources
        for hit in hand_named_loggers(path.read_text(encoding="utf-8"))
        if str(path.relative_to(REPO)) not in KNOWN_LOGGER_NAMES
    ]
    assert not bad, "loggers not named logging.getLogger(__name__):\n" + "\n".join(bad)
    assert hand_named_loggers('import logging\nlog = logging.getLogger("cacheblend_rag.kv_store")')
    assert not hand_named_loggers("import logging\nlog = logging.getLogger(__name__)")


def test_how_it_works_points_at_files_that_exist():
    text = (REPO / "docs" / "how-it-works.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(cacheblend_rag/[^`]+)`", text))
    assert len(named) >= 10, f"docs/how-it-works.md names too few files of the package: {sorted(named)}"
    gone = sorted(p for p in named if not (REPO / p).exists())
    assert not gone, "docs/how-it-works.md names files that do not exist: " + ", ".join(gone)
