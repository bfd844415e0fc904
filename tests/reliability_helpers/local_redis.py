"""A throw-away redis-server on 127.0.0.1 (no persistence, its own port and directory) for tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
WAIT_S = 10.0  # longest wait for a server to start or stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throw-away redis-server on 127.0.0.1: no persistence, its own directory and port."""

    def __init__(self, directory: Path, *extra: str) -> None:
        self.directory, self.extra, self.port = directory, extra, free_port()
        self.proc: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        # Later arguments win: ``extra`` may turn the plain port off for a TLS-only server.
        cmd = [
            str(REDIS_SERVER),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            *self.extra,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on port {self.port} within {WAIT_S}s")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()  # as abrupt as a crash: no shutdown handshake for the clients
        self.proc.wait(timeout=WAIT_S)
        self.proc = None
