"""``ask --keep-alive``: later ``ask``s answered by a process that keeps the model loaded.

Most of a separate later ``ask`` is what every process pays before its first token: Python,
torch's and transformers' imports, reading and packing the weights, loading MiniLM for a new
question (docs/cli.md, "What a later ask costs"). With ``--keep-alive`` it is paid once: an
``ask`` finds the process kept for its model flags (``cli.warm_server``), or starts one, and has it
answer; the process stays until it has been idle for the keep-alive time (as ollama's keep_alive).

Where: ``<cache home>/warm/<key>.sock``, a Unix socket in a folder only the user can open, with
``<key>.lock`` (held by the kept process for its life: one per key) and ``<key>.log`` (its
standard error). The key hashes what the engine depends on: the package's version and code, the
Python, the model flags and the environment that changes a load.

Protocol, one JSON object a line, one connection per ``ask``:

* ``ask``: ``{"ask": flags, "keep_alive": seconds}``, ``{"question": text}`` per question, ``{"end": true}``;
* the kept process: ``{"out": text}`` and ``{"err": text}`` while it answers, ``{"done": true}``
  after each question, ``{"exit": status}`` last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cacheblend_rag import __version__
from cacheblend_rag.model.loading import default_cache_dir

ENV = "CACHEBLEND_RAG_KEEP_ALIVE"  # --keep-alive's default
# The flags the kept process's engine is opened with: an ask with other values gets another process.
ENGINE_FLAGS = ("model", "device", "dtype", "weights", "store", "kv_format")
# The environment a load depends on (threads, the cache home, the hub cache), in the key.
_ENV_PREFIXES = ("CACHEBLEND_RAG_", "OMP_", "MKL_", "CUDA_", "HF_", "TRANSFORMERS_")
ALREADY_KEPT = 3  # warm_server's exit status when another process holds the key's lock
# How long an ask waits for a starting process to listen: a first load may convert a GGUF file
# and run the load-time checks, minutes for a large model on a slow disk.
START_TIMEOUT_S = 600.0
_SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


class Disconnected(Exception):
    """The other end of a kept-process connection closed it."""


def duration(text: str) -> float:
    """``--keep-alive``: seconds, or a number with s, m or h; 0 stops the kept process after this
    answer; a negative duration (-1) keeps it until it is stopped (returned as -1)."""
    t = text.strip().lower()
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    try:
        seconds = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: pass seconds or a number with s, m or h (300, 5m, 1h), 0 to stop the kept "
            "process after this answer, or -1 to keep it until it is stopped"
        )
    return -1.0 if seconds < 0 else seconds


@dataclass(frozen=True)
class Place:
    """Where the kept process for one key listens, locks and logs."""

    socket: Path
    lock: Path
    log: Path

    @classmethod
    def at(cls, sock: Path) -> Place:
        return cls(sock, sock.with_suffix(".lock"), sock.with_suffix(".log"))

    @classmethod
    def of(cls, flags: dict[str, Any]) -> Place:
        """The place of the process for ``flags`` (:func:`flags`' engine flags)."""
        key = _key(flags)
        folder = default_cache_dir() / "warm"
        if len(str(folder / f"{key}.sock")) > _SOCKET_PATH_MAX:  # a deep cache home: a socket path must be short
            folder = Path(tempfile.gettempdir()) / f"cacheblend-rag-{os.getuid()}"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)  # the socket answers whoever can open it
        return cls.at(folder / f"{key}.sock")


def flags(args: argparse.Namespace) -> dict[str, Any]:
    """``ask``'s flags as the kept process reads them: paths absolute (it runs elsewhere)."""
    out = {k: v for k, v in vars(args).items() if k != "func"}
    out["files"] = [os.path.abspath(f) for f in args.files]
    if args.model and os.path.exists(os.path.expanduser(args.model)):
        out["model"] = os.path.abspath(os.path.expanduser(args.model))
    return out


def _key(flags: dict[str, Any]) -> str:
    package = Path(__file__).resolve().parents[1]
    code = max(p.stat().st_mtime_ns for p in package.rglob("*.py"))  # an edited install is another engine
    model = flags["model"]
    if model and os.path.exists(model):
        model = f"{model}@{os.stat(model).st_mtime_ns}"
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k != ENV)
    parts = [__version__, code, sys.executable, model, *(flags[f] for f in ENGINE_FLAGS[1:]), env]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def send(conn: socket.socket, message: dict[str, Any]) -> None:
    """One protocol line; :class:`Disconnected` when the other end has closed."""
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError as exc:
        raise Disconnected(str(exc)) from None


def ask(args: argparse.Namespace, questions: Iterator[str]) -> int | None:
    """Answer ``questions`` as ``ask`` would, through the process kept for ``args``' model flags,
    started when there is none (``args.keep_alive`` 0: only one already kept); the exit status, or
    None where no kept process could answer before any question was taken (the caller answers
    them in its own process)."""
    if os.name != "posix":
        print(
            "warning: --keep-alive needs Unix sockets and file locks (Linux, macOS); answering in this process", file=sys.stderr
        )
        return None
    sent = flags(args)
    place = Place.of(sent)
    conn = _connect(place.socket)
    if conn is None and args.keep_alive != 0:
        conn = _start(sent, place)
    if conn is None:
        return None
    with conn, conn.makefile("r", encoding="utf-8") as reader:
        try:
            send(conn, {"ask": sent, "keep_alive": args.keep_alive})
        except Disconnected:
            return None  # it closed as it went idle: nothing asked yet
        try:
            for question in questions:
                send(conn, {"question": question})
                status = _relay(reader)
                if status is not None:
                    return status
            send(conn, {"end": True})
            while (status := _relay(reader)) is None:
                pass
            return status
        except (Disconnected, ConnectionError, ValueError) as exc:
            print(f"error: the process keeping the model loaded stopped ({exc}); its log: {place.log}", file=sys.stderr)
            return 1


def _relay(reader: IO[str]) -> int | None:
    """Print the kept process's output until the question is answered (None) or the run ends
    (its exit status)."""
    for line in reader:
        message = json.loads(line)
        if "out" in message:
            sys.stdout.write(message["out"])
            sys.stdout.flush()
        elif "err" in message:
            sys.stderr.write(message["err"])
            sys.stderr.flush()
        elif "done" in message:
            return None
        elif "exit" in message:
            return int(message["exit"])
    raise ConnectionError("it closed the connection")


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:  # none there, or a socket left by a process that was killed
        conn.close()
        return None
    return conn


def _start(sent: dict[str, Any], place: Place) -> socket.socket | None:
    """Start the kept process for ``sent`` (or wait for the one another ``ask`` is starting) and
    connect to it; None, with a warning naming its log, where it stopped before it listened."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cacheblend_rag.cli.warm_server", str(place.socket)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
    )
    # The flags travel on standard input, not the command line: a Redis URL's password stays out of ps.
    launcher.communicate(json.dumps({f: sent[f] for f in ENGINE_FLAGS}).encode(), timeout=60)
    if launcher.returncode not in (0, ALREADY_KEPT):  # it returns once the kept process holds the lock
        _warn(f"its launcher failed with status {launcher.returncode}", place)
        return None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        conn = _connect(place.socket)
        if conn is not None:
            return conn
        if not _held(place.lock):
            _warn("it stopped before it listened", place)
            return None
        time.sleep(0.05)
    _warn(f"it did not listen within {START_TIMEOUT_S:.0f} s", place)
    return None


def _held(lock: Path) -> bool:
    """Whether a kept process holds ``lock`` (loading or serving)."""
    import fcntl  # POSIX only, as the kept process is

    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _warn(why: str, place: Place) -> None:
    last = place.log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:] if place.log.is_file() else []
    print(
        f"warning: could not keep the model loaded: {why} ({': '.join(last) or 'no log'}; its log: {place.log}); "
        "answering in this process",
        file=sys.stderr,
    )
