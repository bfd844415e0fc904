"""Tables in the docs generated from the committed result files, never typed by hand.

A page holds a generated table between ``<!-- table: NAME -->`` and ``<!-- /table -->``.
``python -m cacheblend_rag.bench.doc_tables`` rewrites every such block in ``README.md`` and
``docs/*.md`` from its result file; ``--check`` only reports blocks that differ (the test suite runs
it, so a changed row changes the page or fails the tests).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def _whole_answer(path: Path) -> str:
    from .whole_answer import WholeAnswerConfig, markdown_table, summarize

    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    lengths = WholeAnswerConfig.lengths
    return markdown_table(summarize(rows, lengths), lengths)


def _decode_step(path: Path) -> str:
    from .whole_answer import decode_step_table

    return decode_step_table(json.loads(path.read_text(encoding="utf-8")))


def _format_probe(path: Path) -> str:
    from .format_probe import probe_table

    return probe_table(json.loads(path.read_text(encoding="utf-8")))


def _attribution(path: Path) -> str:
    from .attribution import table_from_file

    return table_from_file(path)


# name: (result file under docs/results, renderer)
TABLES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "whole-answer-smollm2": ("whole_answer_smollm2.jsonl", _whole_answer),
    "decode-step-smollm2": ("decode_step_smollm2.json", _decode_step),
    "whole-answer-qwen05": ("whole_answer_qwen05.jsonl", _whole_answer),
    "decode-step-qwen05": ("decode_step_qwen05.json", _decode_step),
    "format-probe-smollm2": ("weight_formats_probe_smollm2.json", _format_probe),
    "attribution-qwen05": ("attribution_qwen05.jsonl", _attribution),
}


def render(name: str, root: Path = ROOT) -> str:
    if name not in TABLES:
        raise KeyError(f"table marker names {name!r}; known tables: {', '.join(TABLES)}")
    file, renderer = TABLES[name]
    return renderer(root / "docs" / "results" / file) + "\n"


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def update(root: Path = ROOT, write: bool = True) -> list[str]:
    """Regenerate every table block; returns "page: table" for each block that was out of date."""
    stale = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        new = BLOCK.sub(lambda m: m.group(1) + render(m.group(2), root) + m.group(4), text)
        if new != text:
            stale += [f"{page.relative_to(root)}: {m.group(2)}" for m in BLOCK.finditer(text)
                      if m.group(3) != render(m.group(2), root)]
            if write:
                page.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cacheblend_rag.bench.doc_tables", description=__doc__)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    stale = update(write=not args.check)
    for item in stale:
        print(("out of date: " if args.check else "rewrote: ") + item)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
