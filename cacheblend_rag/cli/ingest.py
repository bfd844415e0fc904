"""``cacheblend-rag ingest``: cache a whole corpus's chunks ahead of the questions, resumably.

The corpus is split as ``ask`` splits it (``cli.ask.read_chunks``: text files into chunks of at most
``--chunk-tokens`` tokens, ``.json`` lists as given), plus folders (their text, JSON and JSONL files)
and JSONL files (one document a line, a string or an object with a ``"text"``, split the same way).
Before anything is computed the command prints what it will do (chunks, tokens, bytes in the
store's format) and refuses, naming the fix, when the store's size limit or the disk's free space
cannot hold it (``engine.capacity``, the check every ``precompute`` makes).

Resuming needs no state of its own: every chunk is stored whole or not at all (the store publishes
a chunk by writing its meta record last), and a run computes only the chunks the store lacks.
A run killed at any point (``kill -9`` included) and started again computes the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheblend_rag.engine.capacity import StoreTooSmall, check_room, describe

__all__ = ["read_corpus", "register", "run"]

TEXT_SUFFIXES = (".txt", ".md", ".rst")
CORPUS_SUFFIXES = (*TEXT_SUFFIXES, ".json", ".jsonl")
# ------------------------------------------------------------------------ reading a corpus


def _jsonl_texts(path: Path) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"error: {path}:{n}: not JSON ({exc.msg})") from None
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise SystemExit(f'error: {path}:{n}: expected a string or an object with a "text" string')
            texts.append(text)
    return texts


def _files(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in CORPUS_SUFFIXES)
            if not found:
                raise SystemExit(f"error: {p}: no {', '.join(CORPUS_SUFFIXES)} files in this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"error: {p}: no such file or folder")
    return files


def read_corpus(paths: Sequence[str], tokenizer, max_tokens: int) -> list[str]:
    """The distinct chunks of ``paths`` (files, folders, JSONL corpora), in order, split as ``ask``
    splits its files."""
    from cacheblend_rag.cli.ask import read_chunks, split_text

    chunks: list[str] = []
    for f in _files(paths):
        if f.suffix.lower() == ".jsonl":
            for text in _jsonl_texts(f):
                chunks += split_text(text, tokenizer, max_tokens)
        else:
            chunks += read_chunks([str(f)], tokenizer, max_tokens)
    return list(dict.fromkeys(c for c in chunks if c.strip()))


def run(
    engine,
    chunks: Sequence[str],
    *,
    neighbours: int = 0,
    progress: bool = True,
    out: Any = None,
) -> int:
    """Ingest ``chunks`` into the engine's store: print the plan, refuse (``StoreTooSmall``) what
    the store cannot hold, compute what it lacks with a progress bar. Returns how many caches
    were computed. The plan and the summary go to ``out`` (default: standard error)."""
    out = sys.stderr if out is None else out
    p = engine.plan_precompute(chunks, neighbours=neighbours)
    print(describe(p), file=out, flush=True)
    check_room(p, engine.store)
    t0 = time.perf_counter()
    computed = engine.precompute(chunks, neighbours=neighbours, progress=progress, check_room=False)
    took = time.perf_counter() - t0
    rate = f", {computed / took:.2f} chunks/s" if computed and took > 0 else ""
    print(f"computed {computed:,} chunk caches in {took:.1f} s{rate}", file=out, flush=True)
    return computed


# ------------------------------------------------------------------------ command line


def _ingest(args: argparse.Namespace) -> int:
    from cacheblend_rag.cli.flags import open_engine

    if args.neighbours < 0:
        raise SystemExit(f"error: --neighbours {args.neighbours}: pass how many chunks each cache sits behind (0: none)")
    engine = open_engine(
        args,
        store_size_limit=args.store_size_limit,
        memory_bytes=0,  # every chunk is written once: a memory tier would only hold the last ones
    )
    try:
        chunks = read_corpus(args.paths, engine.tokenizer, args.chunk_tokens)
        if not chunks:
            raise SystemExit("error: the corpus holds no text")
        if args.dry_run:
            p = engine.plan_precompute(chunks, neighbours=args.neighbours)
            print(describe(p))
            check_room(p, engine.store)
            return 0
        run(engine, chunks, neighbours=args.neighbours, progress=not args.quiet)
    except StoreTooSmall as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    finally:
        engine.close()
    return 0


def _size(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 8G, 500M, 1000000)") from None


def register(subparsers) -> None:
    """Add ``ingest`` to the ``cacheblend-rag`` parser."""
    from cacheblend_rag.cli.ask import ASK_NEIGHBOURS
    from cacheblend_rag.cli.flags import STORE_HELP, add_kv_format, add_model_flags

    p = subparsers.add_parser(
        "ingest",
        help="cache the chunks of a folder, files or a JSONL corpus ahead of the questions (resumable)",
        description="Split the corpus as `ask` does, print the chunks, tokens and bytes it will store, refuse what "
        "the store cannot hold, and compute every chunk cache the store lacks (run it again after an interruption).",
    )
    p.add_argument(
        "paths",
        nargs="+",
        help="folders (their .txt, .md, .rst, .json and .jsonl files), text files, .json lists of chunks or "
        '.jsonl files (one document a line: a string or {"text": ...})',
    )
    p.add_argument("--chunk-tokens", type=int, default=256, help="max tokens per chunk when splitting text (default 256, as ask)")
    p.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="also cache each chunk behind its N most similar chunks of the corpus (bundled MiniLM; ask uses "
        f"{ASK_NEIGHBOURS}): answers closer to full prefill's, about N+1 chunk prefills and twice the storage "
        "per chunk (default 0: plain caches only)",
    )
    add_kv_format(p)
    p.add_argument("--store-dir", default=None, help="chunk KV store directory (default: <cache home>/kv)")
    p.add_argument(
        "--store-size-limit", type=_size, default=8 * 2**30, help="the disk store's size limit (default 8G; e.g. 500M, 64G)"
    )
    p.add_argument("--store", default=None, help=STORE_HELP)
    add_model_flags(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan (and any refusal) and compute nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_ingest)
