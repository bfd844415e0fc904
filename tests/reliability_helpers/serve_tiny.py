"""Serve the tiny test model on 127.0.0.1 as `cacheblend-rag serve` runs a model: uvicorn in the
main thread with its signal handlers and the server's limits. Prints "PORT <n>" once listening.

    python3 tests/reliability_helpers/serve_tiny.py [--timeout-drain S] [--store-dir DIR]
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile

import uvicorn

from cacheblend_rag.server import ServerConfig, create_app
from cacheblend_rag.server.limits import uvicorn_config
from cacheblend_rag.testing import make_engine


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout-drain", type=float, default=30.0)
    p.add_argument("--store-dir", default=None)
    args = p.parse_args()
    store = args.store_dir or tempfile.mkdtemp(prefix="cacheblend-serve-tiny-")
    engine = make_engine("llama", tools=True, seed=0, store_dir=store, pipelined=False)
    app = create_app(
        engine, ServerConfig(model_name="tiny", learn_neighbours=False, timeout_drain_s=args.timeout_drain), close_engine=True
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, log_level="warning"))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    try:
        # On SIGTERM uvicorn drains, runs the lifespan's end (which closes the engine), then
        # raises the signal again: nothing after run() runs.
        server.run(sockets=[sock])
    finally:
        if not app.state.engine_closed:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
