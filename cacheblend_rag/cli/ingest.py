"""``cacheblend-rag ingest``: cache a whole corpus's chunks ahead of the questions, resumably.

The corpus is split as ``ask`` splits it (``cli.read_chunks``: text files into chunks of at most
``--chunk-tokens`` tokens, ``.json`` lists as given), plus folders (their text, JSON and JSONL files)
and JSONL files (one document a line, a string or an object with a ``"text"``, split the same way).
Before anything is computed the command prints what it will do (chunks, tokens, bytes in the
store's format) and refuses, naming the fix, when the store's size limit or the disk's free space
cannot hold it: a store over its limit evicts its own chunks, a full disk fails every writer.

Resuming needs no state of its own: every chunk is stored whole or not at all (the store publishes
a chunk by writing its meta record last), and a run computes only the chunks the store lacks.
A run killed at any point (``kill -9`` included) and started again computes the rest.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["IngestPlan", "IngestRefused", "check_room", "plan", "read_corpus", "register", "run"]

TEXT_SUFFIXES = (".txt", ".md", ".rst")
CORPUS_SUFFIXES = (*TEXT_SUFFIXES, ".json", ".jsonl")
# Ingestion keeps this share of a disk's free space free: the database and its log grow by more
# than the records (the store's own writes keep a margin too).
DISK_MARGIN = 0.1


class IngestRefused(RuntimeError):
    """The store cannot hold the corpus; the message says how much is needed and what to change."""


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
    from cacheblend_rag.cli.app import read_chunks, split_text

    chunks: list[str] = []
    for f in _files(paths):
        if f.suffix.lower() == ".jsonl":
            for text in _jsonl_texts(f):
                chunks += split_text(text, tokenizer, max_tokens)
        else:
            chunks += read_chunks([str(f)], tokenizer, max_tokens)
    return list(dict.fromkeys(c for c in chunks if c.strip()))


# ------------------------------------------------------------------------ the plan


@dataclass
class IngestPlan:
    """What ingesting a corpus stores. ``new_bytes``: bytes of the caches the store lacks;
    ``total_bytes``: of every cache of the corpus (what the store must hold at once). With
    neighbours, each chunk has a second cache (behind its neighbours), counted as missing where
    its plain cache is."""

    chunks: int
    cached: int
    tokens: int
    new_tokens: int
    new_bytes: int
    total_bytes: int
    kv_format: str
    neighbours: int
    prefix_bytes: int = 0  # of the instruction prefix's cache, in both totals

    @property
    def bytes_per_token(self) -> float:
        """Bytes of one cache per token of the corpus's chunks."""
        chunk_bytes = self.total_bytes - self.prefix_bytes
        return chunk_bytes / self.tokens / (2 if self.neighbours else 1) if self.tokens else 0.0


def _disk_stores(store: Any) -> list[Any]:
    """The tiers of ``store`` that keep chunks on disk (a bare disk store, or a tiered store's)."""
    stores = [t.store for t in store.tiers] if hasattr(store, "tiers") else [store]
    return [s for s in stores if hasattr(s, "size_limit") and hasattr(s, "directory")]


def _format_of(store: Any):
    formats = [s.kv_format for s in _disk_stores(store) if getattr(s, "kv_format", None) is not None]
    return formats[0] if formats else getattr(store, "kv_format", None)


def plan(engine, chunks: Sequence[str], neighbours: int = 0, store: Any = None) -> IngestPlan:
    """How many of ``chunks`` ``store`` (default the engine's) lacks, their tokens and the bytes
    their caches take in the store's format (records, meta records and MACs; the instruction
    prefix's cache included)."""
    from cacheblend_rag.store.lookup import contains_many
    from cacheblend_rag.store.meta import ChunkMeta, encode_meta
    from cacheblend_rag.store.record import layer_record_bytes
    from cacheblend_rag.store.seal import MAC_SIZE, sealer

    store = engine.store if store is None else store
    fmt = _format_of(store)
    heads, head_dim = engine.kv_shape
    trailer = MAC_SIZE if sealer().keyed else 0
    segments = [engine.prompts.chunk_segment(c) for c in chunks]
    have = contains_many(store, [engine.chunk_key(s, engine.prompts.prefix_ids) for s in segments])
    copies = 2 if neighbours else 1
    meta = len(encode_meta(ChunkMeta(1, 1, "float32"))) + trailer  # the same size for every chunk

    def size(n: int) -> int:  # an n-token chunk's caches
        record = layer_record_bytes((heads, n, head_dim), engine.dtype, fmt) + trailer
        return copies * (engine.num_layers * record + meta)

    missing = [len(s) for s, hit in zip(segments, have) if not hit]
    # The instruction prefix is stored once too (prefix caching finds it), as a plain cache.
    prefix = len(engine.prompts.prefix_ids)
    prefix_bytes = size(prefix) // copies
    prefix_new = 0 if store.contains(engine.chunk_cache.prefix_key()) else prefix_bytes
    return IngestPlan(
        chunks=len(segments),
        cached=len(segments) - len(missing),
        tokens=sum(len(s) for s in segments),
        new_tokens=sum(missing),
        new_bytes=sum(size(n) for n in missing) + prefix_new,
        total_bytes=sum(size(len(s)) for s in segments) + prefix_bytes,
        kv_format="float" if fmt is None else fmt.name,
        neighbours=neighbours,
        prefix_bytes=prefix_bytes,
    )


def check_room(p: IngestPlan, store: Any) -> None:
    """Raise :class:`IngestRefused` when a disk tier of ``store`` cannot hold the corpus: its size
    limit is below all of the corpus's caches (the last chunks would evict the first), or its
    disk has not the free space for the missing ones (plus ``DISK_MARGIN``)."""
    hint = {
        "float": " or keep fewer bytes per token (--kv-format int8: about a quarter)",
        "int8": " or keep fewer bytes per token (--kv-format int4: about half, at some cost in answers)",
    }.get(p.kv_format, "")
    for disk in _disk_stores(store):
        if p.total_bytes > disk.size_limit:
            raise IngestRefused(
                f"the corpus's chunk caches take about {p.total_bytes:,} bytes ({p.chunks:,} chunks, {p.tokens:,} tokens, "
                f"{p.kv_format}), more than the store's size limit of {disk.size_limit:,} bytes: its last chunks would "
                f"evict its first. Raise --store-size-limit{hint}, or ingest part of the corpus"
            )
        try:
            free = shutil.disk_usage(disk.directory).free
        except OSError:
            continue
        if p.new_bytes > free * (1 - DISK_MARGIN):
            raise IngestRefused(
                f"the missing chunk caches take about {p.new_bytes:,} bytes, and the disk of {disk.directory} has "
                f"{free:,} bytes free (ingestion leaves {DISK_MARGIN:.0%} of it): free space, point --store-dir at a "
                f"larger disk{hint}"
            )


def describe(p: IngestPlan) -> str:
    nb = f", each also behind its {p.neighbours} nearest chunks" if p.neighbours else ""
    return (
        f"{p.chunks:,} chunks ({p.cached:,} cached, {p.chunks - p.cached:,} to compute{nb}), {p.tokens:,} tokens; "
        f"about {p.new_bytes:,} bytes to store in {p.kv_format} ({p.bytes_per_token:,.0f} bytes per token), "
        f"{p.total_bytes:,} for the whole corpus"
    )


def run(
    engine,
    chunks: Sequence[str],
    *,
    neighbours: int = 0,
    progress: bool = True,
    out: Any = None,
) -> int:
    """Ingest ``chunks`` into the engine's store: print the plan, refuse (``IngestRefused``) what
    the store cannot hold, compute what it lacks with a progress bar. Returns how many caches
    were computed. The plan and the summary go to ``out`` (default: standard error)."""
    out = sys.stderr if out is None else out
    p = plan(engine, chunks, neighbours)
    print(describe(p), file=out, flush=True)
    check_room(p, engine.store)
    t0 = time.perf_counter()
    computed = engine.precompute(list(chunks), neighbours=neighbours, progress=progress)
    took = time.perf_counter() - t0
    rate = f", {computed / took:.2f} chunks/s" if computed and took > 0 else ""
    print(f"computed {computed:,} chunk caches in {took:.1f} s{rate}", file=out, flush=True)
    return computed


# ------------------------------------------------------------------------ command line


def _ingest(args: argparse.Namespace) -> int:
    from cacheblend_rag.cli.app import open_engine

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
            p = plan(engine, chunks, args.neighbours)
            print(describe(p))
            check_room(p, engine.store)
            return 0
        run(engine, chunks, neighbours=args.neighbours, progress=not args.quiet)
    except IngestRefused as exc:
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
    from cacheblend_rag.cli.app import ASK_NEIGHBOURS, STORE_HELP, WEIGHTS_HELP, add_kv_format
    from cacheblend_rag.model.weights import AUTO, WEIGHT_CHOICES

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
    p.add_argument("--model", default=None, help="model dir, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--weights", default=AUTO, choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)
    p.add_argument("--dry-run", action="store_true", help="print the plan (and any refusal) and compute nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_ingest)
