"""The benchmark subcommands of ``cacheblend-rag``, plugged into the core's command line.

The core's parser (``cacheblend_rag.cli.app``) knows only ``ask`` and ``serve``; it adds the commands
of every ``cacheblend_rag.commands`` entry point, and pyproject.toml names :func:`register` there.
"""

from __future__ import annotations

import argparse
import importlib

# Each module defines ``register(subparsers)``; the commands appear in this order in ``--help``.
MODULES = (
    "sweep",
    "cli",
    "fidelity",
    "calibrate",
    "profile_cli",
    "pipeline_bench",
    "headline",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sweep``, ``bench``, ``fidelity``, ``calibrate``, ``profile``, ``pipeline-bench`` and ``headline``."""
    for name in MODULES:
        importlib.import_module(f"{__package__}.{name}").register(subparsers)
