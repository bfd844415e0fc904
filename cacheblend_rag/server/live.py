"""Serve an app from a background thread of this process (tests, benchmarks, notebooks).

The socket is bound here, to a free port of 127.0.0.1 unless told otherwise, before uvicorn
starts, so the port is known up front and no other process can take it in between.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from cacheblend_rag.server.limits import uvicorn_config


class BackgroundServer:
    """``start()`` returns once uvicorn accepts connections; ``stop()`` shuts it down gracefully
    (open requests finish first) and waits for the thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", timeout_s: float = 60.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.timeout_s = timeout_s
        # The app's ServerConfig limits and timeouts (limits.uvicorn_config), as `serve` runs it.
        self.server = uvicorn.Server(uvicorn_config(app, log_level=log_level, lifespan="on"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="cacheblend-background-server"
        )

    def start(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start within {self.timeout_s:.0f} s")
            time.sleep(0.01)
        return self

    def request_stop(self) -> None:
        """Begin the graceful shutdown without waiting for it."""
        self.server.should_exit = True

    def stop(self) -> None:
        self.request_stop()
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the server on {self.url} did not stop within {self.timeout_s:.0f} s")

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
