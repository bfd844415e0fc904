"""``cacheblend-rag``: ask questions over documents, run the sweep, benchmarks and profiles.

This module: the parser, ``serve`` and ``main``; ``ask`` is ``cli.ask``."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from cacheblend_rag import __version__
from cacheblend_rag.cli import ask
from cacheblend_rag.cli.flags import (
    ADAPTIVE_HELP,
    GUARD_HELP,
    STORE_HELP,
    add_kv_format,
    add_model_flags,
    check_guard,
    guarded,
    open_engine,
)
from cacheblend_rag.cli.paths import DataFileError
from cacheblend_rag.errors import ModelLoadError

# Commands beyond ask and serve come from entry points of this group (pyproject.toml: ingest and
# store, which build on ask's reading and the shared flags, and the benchmarks' sweep, bench,
# fidelity, calibrate, profile, pipeline-bench), so this module imports none of them. Each names
# a function ``register(subparsers)``.
COMMANDS_GROUP = "cacheblend_rag.commands"

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
    check_guard(args.guard_margin)
    engine = open_engine(args)
    app = None
    try:
        engine.config = guarded(engine.config, args.guard_margin, args.adaptive)
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


# The commands of this module's own: parsing one needs none of the plugged-in commands, whose
# modules (the benchmarks' import the store's Redis client) would cost every ask ~0.3 s to load.
OWN_COMMANDS = ("ask", "serve")


def build_parser(plugins: bool = True) -> argparse.ArgumentParser:
    """The ``cacheblend-rag`` parser; ``plugins``: with the ``cacheblend_rag.commands`` entry points'
    commands (without: ``ask`` and ``serve`` only)."""
    parser = argparse.ArgumentParser(prog="cacheblend-rag", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    ask.register(sub)
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (docs/server.md)")
    add_model_flags(serve)
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
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=_serve)
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name) if plugins else ():
        entry.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(plugins=not argv or argv[0] not in OWN_COMMANDS).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (DataFileError, ModelLoadError) as err:
        # A model the flags cannot load (its path, its format): one line, not a traceback.
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
