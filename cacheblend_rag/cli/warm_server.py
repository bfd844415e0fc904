"""The process ``ask --keep-alive`` keeps (``cli.warm``: where it listens, the protocol): the
engine and MiniLM loaded, answering one ``ask`` at a time as ``ask`` itself does (``cli.ask.answer``)
until it has been idle for the keep-alive time the last ``ask`` gave.

    python -m cacheblend_rag.cli.warm_server SOCKET    (the engine flags as JSON on standard input)

It returns at once: 0 once the kept process it forks holds the key's lock, ``warm.ALREADY_KEPT``
when another process holds it. The kept process logs to the ``.log`` next to ``SOCKET``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from cacheblend_rag.cli import ask, warm
from cacheblend_rag.cli.flags import open_engine
from cacheblend_rag.model.loading import default_cache_dir

if TYPE_CHECKING:
    from cacheblend_rag.embedder import CachedEmbedder
    from cacheblend_rag.engine.core import CacheBlendEngine


class _Channel(io.TextIOBase):
    """Standard output or error of one ``ask``: each write a protocol line to its connection."""

    encoding = "utf-8"

    def __init__(self, conn: socket.socket, name: str) -> None:
        super().__init__()
        self.conn, self.name = conn, name

    def write(self, text: str) -> int:
        if text:
            warm.send(self.conn, {self.name: text})
        return len(text)

    def isatty(self) -> bool:
        return False


def main(argv: list[str]) -> int:
    place = warm.Place.at(Path(argv[0]))
    engine_flags = json.loads(sys.stdin.read())
    lock = place.lock.open("a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return warm.ALREADY_KEPT
    # Forked before anything starts a thread; the child inherits the lock (the same open file)
    # and keeps it for its life, so an ask that sees it free knows no process is coming.
    if os.fork():
        os._exit(0)
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(place.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    os.close(null)
    os.close(log)
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")  # who to stop: kill $(cat <key>.lock)
    lock.flush()
    return serve(place, argparse.Namespace(**engine_flags, keep_alive=None))


def serve(place: warm.Place, args: argparse.Namespace) -> int:
    """Load the engine ``args`` names, listen on ``place.socket`` and answer until idle."""
    from cacheblend_rag.embedder import CachedEmbedder

    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: loading {args.model or 'the bundled model'}", flush=True)
    engine = open_engine(args)
    embed = CachedEmbedder(default_cache_dir() / ask.ASK_CACHE)  # MiniLM loads once, for the first new question
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    place.socket.unlink(missing_ok=True)  # left by a process that was killed: the lock says none runs
    listener.bind(str(place.socket))
    os.chmod(place.socket, 0o600)
    listener.listen(8)
    signal.signal(signal.SIGTERM, _stop)
    print(f"listening on {place.socket}", flush=True)
    keep_alive, healthy = warm.START_TIMEOUT_S, True  # until the ask that started it connects
    try:
        while keep_alive != 0 and healthy:
            listener.settimeout(None if keep_alive < 0 else keep_alive)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                break
            keep_alive, healthy = _serve_one(conn, engine, embed, keep_alive)
        place.socket.unlink(missing_ok=True)
        # An ask that connected before the socket went waits for its answer: give it.
        listener.setblocking(False)
        while healthy:
            try:
                conn, _ = listener.accept()
            except OSError:
                break
            conn.setblocking(True)
            _, healthy = _serve_one(conn, engine, embed, 0)
    except _Stopped:
        pass
    finally:
        place.socket.unlink(missing_ok=True)
        listener.close()
        embed.close()
        engine.close()  # saves what the engine learned (neighbours), as a closing ask does
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} stopped", flush=True)
    return 0


class _Stopped(BaseException):
    """SIGTERM: stop now (an answer under way is dropped), closing the engine as an idle stop does."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped


def _serve_one(conn: socket.socket, engine: CacheBlendEngine, embed: CachedEmbedder, keep_alive: float) -> tuple[float, bool]:
    """One ``ask`` over ``conn``: its answers and exit status. Returns the keep-alive it asked
    for and whether this process can go on (an unexpected error ends it: the next ask starts afresh)."""
    healthy = True
    with conn, conn.makefile("r", encoding="utf-8") as reader:
        try:
            first = json.loads(reader.readline() or "{}")
            args = argparse.Namespace(**first["ask"])
            keep_alive = float(first["keep_alive"])
        except (ValueError, KeyError, TypeError, OSError):
            return keep_alive, True  # not an ask: nothing to answer
        try:
            with contextlib.redirect_stdout(_Channel(conn, "out")), contextlib.redirect_stderr(_Channel(conn, "err")):
                try:
                    status = ask.answer(engine, args, _questions(reader, conn), embed)
                except SystemExit as exc:  # a refusal (a missing file, ...), as ask's own process exits with it
                    status = _status(exc)
                except warm.Disconnected:
                    raise
                except Exception:  # noqa: BLE001 - reported to the ask and the log; this process then ends
                    traceback.print_exc()  # to the ask, and below to the log
                    traceback.print_exc(file=sys.__stderr__)
                    status, healthy = 1, False
            warm.send(conn, {"exit": status})
        except warm.Disconnected:
            pass  # the ask was stopped (Ctrl-C): its answer is dropped, the engine is fine
    return keep_alive, healthy


def _questions(reader: IO[str], conn: socket.socket) -> Iterator[str]:
    """The ask's questions; after each is answered, ``done`` (the ask then sends the next)."""
    for line in reader:
        message = json.loads(line)
        if "question" not in message:
            return
        yield str(message["question"])
        warm.send(conn, {"done": True})


def _status(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
