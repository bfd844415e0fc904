"""Data files the commands read, from a flag or an environment variable, never from a guessed path.

A command that needs a data file takes it from its flag (``--musique PATH``) or, when the flag is
not given, from the environment variable named in :data:`DATA_FILES`. Nothing is looked up beside
the checkout: a missing file is an error that names the flag and the variable to set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataFile:
    """One kind of data file: the flag that passes it, its variables (first set wins), what it holds."""

    flag: str
    env: tuple[str, ...]
    description: str


DATA_FILES: dict[str, DataFile] = {
    "musique": DataFile(
        flag="--musique",
        # CACHEBLEND_MUSIQUE is the older name, still honoured.
        env=("CACHEBLEND_RAG_MUSIQUE", "CACHEBLEND_MUSIQUE"),
        description="MuSiQue dev in CacheBlend's format: a JSON list of {ctxs: [{title, text}], question, answers}",
    ),
}


class DataFileError(FileNotFoundError):
    """A data file was not given, or the given path is not a file; the message says how to pass it."""


def data_file(name: str, value: str | os.PathLike[str] | None = None) -> Path:
    """The path of data file ``name``: ``value`` (the flag's value) if given, else its environment
    variable; raises :class:`DataFileError` naming the flag and the variable otherwise."""
    spec = DATA_FILES.get(name)
    if spec is None:
        raise KeyError(f"unknown data file {name!r}; known: {', '.join(sorted(DATA_FILES))}")
    if value is not None and str(value) != "":
        source = f"{spec.flag} {value}"
        path = Path(value).expanduser()
    else:
        var = next((v for v in spec.env if os.environ.get(v)), None)
        if var is None:
            raise DataFileError(
                f"no {name} data file given: pass {spec.flag} PATH or set {spec.env[0]}=PATH ({spec.description})"
            )
        source = f"{var}={os.environ[var]}"
        path = Path(os.environ[var]).expanduser()
    if not path.is_file():
        raise DataFileError(
            f"{source}: {str(path)!r} is not a file; pass {spec.flag} PATH to an existing file ({spec.description})"
        )
    return path
