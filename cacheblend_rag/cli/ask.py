"""``cacheblend-rag ask``: answer questions over text files or JSON lists of chunks.

The files are split (langchain-text-splitters), each question's chunks retrieved with the bundled
MiniLM and answered through the request path every front end takes (``serving.Run``). With
``--keep-alive`` the answering happens in a process that keeps the model loaded (``cli.warm``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sqlite3
import sys
from collections.abc import Iterable, Iterator
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

from cacheblend_rag.cli import warm
from cacheblend_rag.cli.flags import (
    ADAPTIVE_HELP,
    GUARD_HELP,
    STORE_HELP,
    add_kv_format,
    add_model_flags,
    check_guard,
    check_weights,
    guarded,
    open_engine,
)
from cacheblend_rag.config import FUSED_MODES, MODES
from cacheblend_rag.model.loading import default_cache_dir

if TYPE_CHECKING:
    from cacheblend_rag.embedder import CachedEmbedder, Embedder
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.engine.stream import GenerationResult

log = logging.getLogger(__name__)

# How many chunks ask caches each retrieved chunk behind (the engine's precompute(neighbours=n)).
ASK_NEIGHBOURS = 2


def split_text(text: str, tokenizer, max_tokens: int) -> list[str]:
    """Split a document into chunks of at most ``max_tokens`` of the model's tokens, at paragraph
    breaks first, then lines, then words (langchain-text-splitters' recursive splitter)."""
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    splitter = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(tokenizer, chunk_size=max_tokens, chunk_overlap=0)
    return [chunk for chunk in splitter.split_text(text) if chunk.strip()]


# What ``ask`` keeps between runs besides the chunk caches, in CACHEBLEND_RAG_HOME: each text
# file's split and the MiniLM vector of each chunk and question, by content (SplitCache,
# embedder.CachedEmbedder). Deleting the file only costs the next run the splitting and embedding.
ASK_CACHE = "ask.sqlite"
STDIN = "-"  # ask's question argument that reads the questions from standard input


class SplitCache:
    """Each text's chunks by its content, the tokenizer's model (``model``: the engine's
    fingerprint) and ``--chunk-tokens``, in an SQLite table: a second ``ask`` over unchanged files
    does not split (tokenize) them again. A file that cannot be used is reported once in the log
    and the texts are split as without it."""

    TABLE = "splits"

    def __init__(self, path: str | Path, model: str) -> None:
        self.path, self.model = Path(path), model
        self._db: sqlite3.Connection | None = None
        self._broken = False

    def split(self, text: str, tokenizer, max_tokens: int) -> list[str]:
        key = hashlib.sha256(f"{self.model}\0{max_tokens}\0{text}".encode()).hexdigest()
        row = self._query(f"SELECT chunks FROM {self.TABLE} WHERE key = ?", (key,))
        if row is not None:
            try:
                chunks = json.loads(row[0])
                if isinstance(chunks, list) and all(isinstance(c, str) for c in chunks):
                    return chunks
            except (TypeError, ValueError):
                pass  # unreadable: split again and replace it
        chunks = split_text(text, tokenizer, max_tokens)
        self._query(f"INSERT OR REPLACE INTO {self.TABLE} VALUES (?, ?)", (key, json.dumps(chunks)))
        return chunks

    def _query(self, sql: str, params: tuple) -> tuple | None:
        if self._broken:
            return None
        try:
            if self._db is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
                self._db.execute(f"CREATE TABLE IF NOT EXISTS {self.TABLE} (key TEXT PRIMARY KEY, chunks TEXT) WITHOUT ROWID")
            return self._db.execute(sql, params).fetchone()
        except (sqlite3.Error, OSError) as exc:
            log.warning("could not use the split cache %s (files are split again): %r", self.path, exc)
            self._broken = True
            self.close()
            return None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def read_chunks(paths: list[str], tokenizer, max_tokens: int, splits: SplitCache | None = None) -> list[str]:
    """The chunks of ``paths``: text files split by :func:`split_text` (through ``splits`` when
    given), ``.json`` lists taken as they are."""
    chunks: list[str] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise SystemExit(f"error: {p}: no such file (pass text files or a .json list of chunks)")
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            if not isinstance(data, list):
                raise SystemExit(f"error: {p}: expected a JSON list of strings or of {{'text': ...}} objects")
            chunks += [d["text"] if isinstance(d, dict) else d for d in data]
        else:
            text = path.read_text(encoding="utf-8")
            chunks += split_text(text, tokenizer, max_tokens) if splits is None else splits.split(text, tokenizer, max_tokens)
    return chunks


def retrieve(question: str, chunks: list[str], top_k: int, embed: Embedder | None = None) -> list[str]:
    """The ``top_k`` chunks most similar to ``question`` (``embed``, default the bundled
    all-MiniLM-L6-v2), best first; every chunk when ``top_k`` is 0 or at least their number."""
    if top_k == 0 or top_k >= len(dict.fromkeys(chunks)):
        return chunks
    from cacheblend_rag.embedder import most_similar

    return most_similar(question, chunks, top_k, embed)


def questions(text: str) -> Iterator[str]:
    """``ask``'s questions: ``text`` itself, or with ``-`` each non-blank line of standard input
    (a prompt on standard error where a person types them) until its end."""
    if text != STDIN:
        yield text
        return
    while True:
        if sys.stdin.isatty():
            print("question> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def _ask(args: argparse.Namespace) -> int:
    if args.top_k < 0:
        raise SystemExit(f"error: --top-k {args.top_k}: pass a number of chunks >= 1, or 0 to send every chunk")
    check_guard(args.guard_margin)
    check_weights(args)
    if args.keep_alive is not None:
        status = warm.ask(args, questions(args.question))
        if status is not None:
            return status
    from cacheblend_rag.embedder import CachedEmbedder

    engine = open_engine(args)
    embed = CachedEmbedder(default_cache_dir() / ASK_CACHE)
    try:
        return answer(engine, args, questions(args.question), embed)
    finally:
        embed.close()
        engine.close()


def answer(engine: CacheBlendEngine, args: argparse.Namespace, questions: Iterable[str], embed: CachedEmbedder) -> int:
    """Answer ``questions`` over ``args.files`` with ``engine`` as ``args`` says, reporting each on
    standard output (errors on standard error); the exit status (1: a question failed). The
    engine's config is as it was afterwards."""
    config = engine.config
    # Splits and vectors from earlier runs (by content): a second ask over unchanged files
    # neither splits nor embeds them again, and loads MiniLM only for a question it has not seen.
    splits = SplitCache(default_cache_dir() / ASK_CACHE, engine.fingerprint)
    try:
        engine.config = guarded(config, args.guard_margin, args.adaptive)
        corpus = read_chunks(args.files, engine.tokenizer, args.chunk_tokens, splits)
        failed = 0
        # Questions from standard input share this process: the model, splits and caches load once.
        for question in questions:
            try:
                _answer(engine, args, question, corpus, embed)
            except ValueError as exc:  # a question the model cannot take fails alone; the exit status says so
                failed += 1
                if args.json:
                    print(json.dumps({"question": question, "error": str(exc)}), flush=True)
                else:
                    print(f"error: {exc}", file=sys.stderr, flush=True)
    finally:
        engine.config = config
        splits.close()
    return 1 if failed else 0


def _answer(engine: CacheBlendEngine, args: argparse.Namespace, question: str, corpus: list[str], embed: CachedEmbedder) -> None:
    """Retrieve ``question``'s chunks from ``corpus``, answer it (streamed unless ``--json``) and report."""
    from cacheblend_rag.serving import Request, Run

    chunks = retrieve(question, corpus, args.top_k, embed)
    if not args.no_neighbours and args.mode in FUSED_MODES:
        # Each retrieved chunk also cached behind its most similar chunks of all the files:
        # the neighbour index lives in this process, so this runs for every question,
        # from the stored vectors (only chunks not seen before are embedded) and caches.
        engine.precompute(chunks, neighbours=ASK_NEIGHBOURS, corpus=corpus, embed=embed, progress=not args.json)
    elif args.precompute:
        engine.precompute(chunks, progress=not args.json)
    # The request path every front end takes (the settings checked as the server checks them).
    request = Request.over_chunks(question, chunks).with_settings(
        mode=args.mode, recompute_ratio=args.ratio, max_new_tokens=args.max_new_tokens, temperature=args.temperature
    )
    run = Run(engine, request)
    with closing(iter(run)) as deltas:  # an answer left early (its reader gone) releases the engine at once
        for delta in deltas:
            if not args.json:
                print(delta, end="", flush=True)
    assert run.result is not None
    _report(question, chunks, run.result, args.json, one_line=args.question == STDIN)


def _report(question: str, chunks: list[str], res: GenerationResult, as_json: bool, one_line: bool) -> None:
    """One answer's JSON object (on one line for a stream of questions), or the stats line after
    the streamed answer."""
    s = res.stats
    if as_json:
        out = {
            "question": question,
            "answer": res.text,
            "finish_reason": res.finish_reason,
            "ttft_s": res.ttft_s,
            "total_s": res.total_s,
            "chunks": chunks,
            "stats": s,
        }
        print(json.dumps(out, indent=None if one_line else 1, default=_jsonable), flush=True)
        return
    print()
    print(
        f"[{s['mode']}] time to first token {res.ttft_s:.2f}s, {s['chunks']} chunks "
        f"({s['chunk_hits']} cached, {s['chunk_misses']} computed now, {s.get('neighbour_hits', 0)} behind their neighbours), "
        f"recomputed {100 * s['recompute_fraction']:.0f}% of token-layers",
        file=sys.stderr,
    )


def _jsonable(value: object) -> object:
    """Numbers and arrays among the stats (numpy / torch scalars) as plain JSON values."""
    for attr in ("tolist", "item"):
        if hasattr(value, attr):
            return getattr(value, attr)()
    return str(value)


def register(sub) -> None:
    """Add ``ask`` to the ``cacheblend-rag`` parser."""
    ask = sub.add_parser("ask", help="answer a question over text files or a JSON list of chunks")
    ask.add_argument(
        "question",
        help="the question, or - to read questions from standard input, one per line, answered in one process "
        "(the model loads once; with --json one object per line)",
    )
    ask.add_argument("files", nargs="+", help="text files (split into paragraph chunks) or .json lists of chunks")
    ask.add_argument(
        "--top-k",
        type=int,
        default=6,
        help="answer over the K chunks most similar to the question (bundled MiniLM embedder; default 6; 0: every chunk)",
    )
    ask.add_argument(
        "--json", action="store_true", help="print one JSON object (answer, chunks used, stats) per question instead of streaming"
    )
    add_model_flags(ask)
    ask.add_argument("--mode", default="cacheblend", choices=list(MODES))
    ask.add_argument("--ratio", type=float, default=None, help="recompute ratio (default 0.15)")
    ask.add_argument("--chunk-tokens", type=int, default=256, help="max tokens per chunk when splitting text files")
    ask.add_argument("--max-new-tokens", type=int, default=64)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument(
        "--precompute",
        action="store_true",
        help="precompute the plain chunk caches first (not counted in TTFT) where the default neighbour-aware "
        "precompute does not run (--no-neighbours, or a --mode other than cacheblend and full_reuse); without it "
        "missing caches are computed during the answer",
    )
    ask.add_argument(
        "--no-neighbours",
        action="store_true",
        help="cache each chunk alone only. By default (--mode cacheblend or full_reuse), before the question is "
        "timed, each retrieved chunk is also "
        f"cached behind its {ASK_NEIGHBOURS} most similar chunks of all the files (bundled MiniLM), which brings "
        f"answers much closer to full prefill's: about {ASK_NEIGHBOURS + 1} chunk prefills per new chunk and one "
        "more chunk cache of storage each; later calls reuse them",
    )
    ask.add_argument("--store", default=None, help=STORE_HELP)
    add_kv_format(ask)
    ask.add_argument("--guard-margin", type=float, default=None, help=GUARD_HELP)
    ask.add_argument("--adaptive", action="store_true", help=ADAPTIVE_HELP)
    ask.add_argument(
        "--keep-alive",
        type=warm.duration,
        default=os.environ.get(warm.ENV),
        metavar="DURATION",
        help="answer from a process that keeps the model loaded, started by the first such ask and kept for "
        "DURATION after its last question (300, 5m, 1h; 0: stop it after this answer; -1: until it is stopped), "
        "which later asks with the same model flags answer from without loading anything "
        f"(default ${warm.ENV}, else off: every ask loads the model; docs/cli.md)",
    )
    ask.set_defaults(func=_ask)
