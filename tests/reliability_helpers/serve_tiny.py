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
    app = create_app(engine, ServerConfig(model_name="tiny", learn_neighbours=False, timeout_drain_s=args.timeout_drain))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, log_level="warning"))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    try:
        server.run(sockets=[sock])  # returns after SIGTERM/SIGINT and the graceful shutdown
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
