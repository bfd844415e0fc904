"""MkDocs hook: replaces ``<!-- cli-help: NAME -->`` in a page with ``cacheblend-rag NAME --help``.

The help text comes from the real argument parser (``cacheblend_rag.cli.app.build_parser``), so the
command-line reference cannot drift from the code. ``<!-- cli-help: -->`` (no name) is the top level;
``<!-- cli-help: store stats -->`` a subcommand's own.
"""

from __future__ import annotations

import argparse
import os
import re

MARKER = re.compile(r"<!-- cli-help: *([\w -]*?) *-->")


def _help(name: str) -> str:
    from cacheblend_rag.cli.app import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal width; fix it for the page
    parser = build_parser()
    for part in name.split():
        subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if subparsers is None or part not in subparsers.choices:
            raise KeyError(f"cli-help marker names {name!r}, which is not a cacheblend-rag command")
        parser = subparsers.choices[part]
    return parser.format_help()


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: "```text\n" + _help(m.group(1)) + "```", markdown)
