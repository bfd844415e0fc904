"""What the benchmark commands (``bench``, ``fidelity``) share on the command line: list
parsers, the configuration a parsed command line fills, and the errors a run reports as one line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any, TypeVar

C = TypeVar("C")


def csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in csv(text))


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in csv(text))


# Configuration fields whose option has another name or form; every other field takes the option
# of its own name where the command has one, and keeps its default where it has none.
_RENAMED: dict[str, Callable[[argparse.Namespace], Any]] = {
    "out_dir": lambda a: a.out,
    "progress": lambda a: not a.quiet,
    "plots": lambda a: not a.no_plots,
    "fidelity": lambda a: not a.no_fidelity,
    "max_batches": lambda a: a.max_batch,
    "dataset": lambda a: a.datasets[0],
}


def config(cls: type[C], args: argparse.Namespace, **fields: Any) -> C:
    """``cls`` (a configuration dataclass) filled from a parsed command line; ``fields`` are the
    values that do not come straight from an option (a default applied, a list narrowed)."""
    values = dict(fields)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in values:
            continue
        if f.name in _RENAMED:
            try:
                values[f.name] = _RENAMED[f.name](args)
            except AttributeError:  # the command has no such option: the field keeps its default
                pass
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**values)


def run_reporting(run: Callable[[], int], errors: tuple[type[Exception], ...] = ()) -> int:
    """``run()``; a missing file or package, missing model parts, a bad value or one of ``errors``
    print one line (``error: ...``, the fix in the message) and exit with 2 instead of a traceback."""
    from cacheblend_bench.qwen import QwenPartsMissing

    try:
        return run()
    except (FileNotFoundError, ImportError, QwenPartsMissing, ValueError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
