"""``cacheblend-rag``: ask questions over documents, run the sweep, benchmarks and profiles."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cacheblend_rag import __version__
from cacheblend_rag.cli.paths import DataFileError
from cacheblend_rag.config import ADAPTIVE_ESCALATION, FUSED_MODES, MODES, BlendConfig
from cacheblend_rag.embedder import CachedEmbedder, Embedder
from cacheblend_rag.errors import ModelLoadError
from cacheblend_rag.model.loading import default_cache_dir
from cacheblend_rag.model.weights import AUTO, WEIGHT_CHOICES
from cacheblend_rag.store.quant import DEFAULT_KV_FORMAT, parse_kv_format

if TYPE_CHECKING:
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.engine.stream import GenerationResult

# Commands beyond ask and serve come from entry points of this group (pyproject.toml: ingest and
# store, which build on this module's reading and flags, and the benchmarks' sweep, bench,
# fidelity, calibrate, profile, pipeline-bench), so this module imports none of them. Each names
# a function ``register(subparsers)``.
COMMANDS_GROUP = "cacheblend_rag.commands"

log = logging.getLogger(__name__)


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


def _questions(text: str) -> Iterator[str]:
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
    _check_guard(args.guard_margin)
    engine = open_engine(args)
    # Splits and vectors from earlier runs (by content): a second ask over unchanged files
    # neither splits nor embeds them again, and loads MiniLM only for a question it has not seen.
    cache = default_cache_dir() / ASK_CACHE
    splits, embed = SplitCache(cache, engine.fingerprint), CachedEmbedder(cache)
    try:
        _guarded(engine, args.guard_margin, args.adaptive)
        corpus = read_chunks(args.files, engine.tokenizer, args.chunk_tokens, splits)
        failed = 0
        # Questions from standard input share this process: the model, splits and caches load once.
        for question in _questions(args.question):
            try:
                _answer(engine, args, question, corpus, embed)
            except ValueError as exc:  # a question the model cannot take fails alone; the exit status says so
                failed += 1
                if args.json:
                    print(json.dumps({"question": question, "error": str(exc)}), flush=True)
                else:
                    print(f"error: {exc}", file=sys.stderr, flush=True)
    finally:
        splits.close()
        embed.close()
        engine.close()
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
    for delta in run:
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


# How many chunks ask caches each retrieved chunk behind (the engine's precompute(neighbours=n)).
ASK_NEIGHBOURS = 2
WEIGHTS_HELP = (
    "linear layers' format: fp32, fp16 (CPU only: half the weight bytes per decoded token) or auto "
    "(default: fp16 for a float32 model on the CPU, else fp32)"
)
# ServerConfig's request limits and connection timeouts as `serve` flags (docs/server.md). The
# defaults are ServerConfig's (this module must not import the server extra to build its parser);
# tests/test_reliability_round3.py checks that the help text states them.
_SERVER_LIMITS: dict[str, tuple[type, str]] = {
    "max_body_bytes": (int, "largest request body in bytes; larger gets 413 (default 8388608)"),
    "max_documents": (int, "most documents per request; more gets 400 (default 64)"),
    "max_document_chars": (int, "most characters per document; more gets 400 (default 100000)"),
    "max_stop_strings": (int, "most stop strings per request; more gets 400 (default 16)"),
    "max_stop_chars": (int, "most characters per stop string; more gets 400 (default 256)"),
    "max_message_chars": (
        int,
        "most characters of a request's messages, tool calls and prompt together, documents apart; more gets 400 "
        "(default 100000)",
    ),
    "timeout_header_s": (float, "seconds a connection may take to send a request's headers (default 10.0)"),
    "timeout_body_s": (float, "seconds a request body may take to arrive; then 408 (default 30.0)"),
    "timeout_keep_alive_s": (int, "seconds an idle keep-alive connection stays open (default 5)"),
    "max_connections": (int, "most open connections; one more closes the oldest idle one (default 128)"),
    "max_header_bytes": (int, "largest request header block in bytes (default 16384)"),
    "timeout_drain_s": (float, "seconds a shutdown (SIGTERM) waits for open requests, then cancels them (default 30.0)"),
}

STORE_HELP = (
    "chunk cache tiers below memory, fastest first, comma-separated: disk, redis://host:6379/0 "
    "(rediss:// for TLS); e.g. disk,redis://cache:6379/0 shares caches through Redis (default: disk)"
)


GUARD_HELP = (
    "the fidelity guard (BlendConfig.guard_margin): answer from a full prefill, on top of the blended one, "
    "whenever the blended first-token margin (log-probability of the first token minus its runner-up's) is "
    "below this, e.g. 0.5 (default: off); measure the trade with python -m cacheblend_bench.guard_curve"
)


def _check_guard(margin: float | None) -> None:
    """Refuse a bad ``--guard-margin`` before the model loads, with the config's own message."""
    try:
        BlendConfig(guard_margin=margin)
    except ValueError as exc:
        raise SystemExit(f"error: --guard-margin: {exc}") from None


def check_weights(args: argparse.Namespace) -> None:
    """Refuse ``--weights fp16`` where it cannot run, before the model loads, in one line (the
    load would refuse it only after loading, with a traceback)."""
    if args.weights == "fp16" and (args.dtype not in ("float32", "fp32") or args.device != "cpu"):
        raise SystemExit(
            f"error: --weights fp16 keeps activations in float32 on the CPU: it needs --dtype float32 and --device cpu, "
            f"not --dtype {args.dtype} --device {args.device} (or leave --weights auto)"
        )


ADAPTIVE_HELP = (
    "adaptive recompute (BlendConfig.escalation = cacheblend_rag.config.ADAPTIVE_ESCALATION): blend a prompt "
    "whose first-token margin is below 0.1 again at ratio 0.3, then 0.6 (default: off; docs/choosing.md)"
)


def _guarded(engine, margin: float | None, adaptive: bool = False) -> None:
    """Give ``engine``'s config (calibrated or default) the guard's threshold and, with
    ``adaptive``, the adaptive recompute preset."""
    if adaptive:
        engine.config = replace(engine.config, escalation=ADAPTIVE_ESCALATION)
    if margin is not None:
        engine.config = replace(engine.config, guard_margin=margin)


def add_kv_format(parser: argparse.ArgumentParser) -> None:
    """``--kv-format``, as ``ask``, ``serve`` and ``ingest`` take it (default ``from_pretrained``'s)."""
    parser.add_argument(
        "--kv-format",
        type=_kv_format,
        default=DEFAULT_KV_FORMAT,
        help=f"format the disk and Redis tiers keep chunk caches in: int8, int4 or float (default {DEFAULT_KV_FORMAT}: "
        "about a quarter of float32's bytes, the same answers; docs/storage.md). Caches of another format are not read",
    )


def _kv_format(text: str) -> str:
    """``--kv-format``, checked before any model loads (``store.quant.parse_kv_format``)."""
    try:
        parse_kv_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def store_tiers(text: str | None) -> list[str] | None:
    """``--store disk,redis://...`` -> the tier list ``from_pretrained(store=...)`` takes."""
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def open_engine(args: argparse.Namespace, **options: Any) -> CacheBlendEngine:
    """The engine a command's flags name (``--model``, ``--device``, ``--dtype``, ``--weights``,
    ``--store``, ``--kv-format`` and, where the command has it, ``--store-dir``), with ``options`` for
    ``from_pretrained``; ``--weights`` is checked before the model loads."""
    from cacheblend_rag.engine.core import CacheBlendEngine

    check_weights(args)
    return CacheBlendEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        store_dir=getattr(args, "store_dir", None),
        store=store_tiers(args.store),
        kv_format=args.kv_format,
        **options,
    )


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from cacheblend_rag.server import ServerConfig, create_app
        from cacheblend_rag.server.limits import uvicorn_settings
    except ImportError as exc:
        raise SystemExit(
            f"error: serve needs the server extra ({exc.name} is missing): pip install 'cacheblend-rag[server]'"
        ) from None

    if args.max_queue < 0:
        raise SystemExit(f"error: --max-queue {args.max_queue}: pass how many requests may wait (>= 0)")
    if args.max_batch < 1:
        raise SystemExit(
            f"error: --max-batch {args.max_batch}: pass how many answers to decode together (>= 1; 1: one at a time)"
        )
    try:
        config = ServerConfig(
            model_name=args.served_model_name,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            learn_neighbours=not args.no_neighbours,
            **{name: getattr(args, name) for name in _SERVER_LIMITS if getattr(args, name) is not None},
        )
    except ValueError as exc:  # checked before the model loads
        raise SystemExit(f"error: {exc}") from None
    _check_guard(args.guard_margin)
    engine = open_engine(args)
    app = None
    try:
        _guarded(engine, args.guard_margin, args.adaptive)
        # uvicorn stops on SIGINT/SIGTERM gracefully: it stops accepting connections, lets open
        # requests finish (--timeout-drain), then runs the app's shutdown, which drains the batcher
        # and closes the engine (saves learned neighbours). It must: after a SIGTERM uvicorn raises
        # the signal again once it has shut down, and nothing after uvicorn.run runs.
        app = create_app(engine, config, close_engine=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, **uvicorn_settings(config))
    finally:
        if app is None or not app.state.engine_closed:  # uvicorn never started, or failed
            engine.close()
    return 0


def _jsonable(value: object) -> object:
    """Numbers and arrays among the stats (numpy / torch scalars) as plain JSON values."""
    for attr in ("tolist", "item"):
        if hasattr(value, attr):
            return getattr(value, attr)()
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheblend-rag", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
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
    ask.add_argument("--model", default=None, help="model dir, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)")
    ask.add_argument("--mode", default="cacheblend", choices=list(MODES))
    ask.add_argument("--ratio", type=float, default=None, help="recompute ratio (default 0.15)")
    ask.add_argument("--chunk-tokens", type=int, default=256, help="max tokens per chunk when splitting text files")
    ask.add_argument("--max-new-tokens", type=int, default=64)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--dtype", default="float32")
    ask.add_argument("--weights", default=AUTO, choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)
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
    ask.set_defaults(func=_ask)
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (docs/server.md)")
    serve.add_argument("--model", default=None, help="model dir, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--store-dir", default=None, help="chunk KV store directory (default: <cache home>/kv)")
    serve.add_argument("--store", default=None, help=STORE_HELP)
    add_kv_format(serve)
    serve.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="answers decoded together, sharing each decode step (default 8; 1: one answer at a time)",
    )
    serve.add_argument(
        "--max-queue", type=int, default=8, help="requests that may wait while --max-batch answers run; more get 503 (default 8)"
    )
    for name, (kind, help_text) in _SERVER_LIMITS.items():
        serve.add_argument("--" + name.removesuffix("_s").replace("_", "-"), dest=name, type=kind, default=None, help=help_text)
    serve.add_argument(
        "--no-neighbours",
        action="store_true",
        help="do not learn neighbour-aware chunk caches from the requests. By default each request's chunks are "
        "also cached behind the chunks in front of them, in the background between requests (one more chunk "
        "prefill behind up to 2 chunks per new cache; storage: up to 4 more caches per chunk), answers come "
        "closer to full prefill's, and a repeated request may be answered differently once its caches exist",
    )
    serve.add_argument("--guard-margin", type=float, default=None, help=GUARD_HELP)
    serve.add_argument("--adaptive", action="store_true", help=ADAPTIVE_HELP)
    serve.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: the model's id)")
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--weights", default=AUTO, choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=_serve)
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        entry.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (DataFileError, ModelLoadError) as err:
        # A model the flags cannot load (its path, its format): one line, not a traceback.
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
