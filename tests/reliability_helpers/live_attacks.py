"""What the server attack tests (rounds three and four) share: the tiny model's name and answer
length, a live server over a module's ``engine`` fixture, a good request and the in-process answer
it must get under attack, and the bytes the process's objects hold."""

from __future__ import annotations

import ctypes
import gc
import time
from typing import Any

import httpx
import pytest

from cacheblend_rag.server import ServerConfig, create_app
from cacheblend_rag.server.live import BackgroundServer
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION

N = 8  # tokens per answer
MODEL = "tiny"
BOUND_S = 60.0  # a bound on waits, never an assertion on time


@pytest.fixture(scope="module")
def expected(engine):
    """The in-process engine's greedy answer: what a good request must get under attack."""
    return engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=N)


def serve(engine, **limits) -> BackgroundServer:
    # Learning off: answers are compared with the engine's, before and after other requests.
    return BackgroundServer(
        create_app(engine, ServerConfig(model_name=MODEL, learn_neighbours=False, **limits)), timeout_s=BOUND_S
    ).start()


def chat_body(**fields) -> dict[str, Any]:
    """A chat request for the sample question, with ``fields`` added or replaced."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": SAMPLE_QUESTION}], "max_tokens": N}
    body.update(fields)
    return body


def good(url: str, timeout: float = BOUND_S) -> dict:
    """A good request's answer (the sample question over the sample chunks), asserted 200."""
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(documents=SAMPLE_CHUNKS), timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def held_bytes() -> int:
    """Bytes this process's objects hold, after a garbage collection: what glibc's ``malloc`` has
    handed out and not got back (``mallinfo2``: arenas in use plus mmapped blocks), where every
    request body, text and container over 512 bytes lives. Not resident memory: which of the free
    pages ``malloc_trim`` gives back varies with the threads' arenas, so resident memory after
    the same four refused 7 MB bodies swung by 27 MB either way from run to run (one CI run: 83 MB
    up) while the bytes in use came back to the byte. Elsewhere than glibc: resident bytes."""
    gc.collect()
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        return info.uordblks + info.hblkhd
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def held_growth(before: int, slack: int, settle_s: float = 3.0) -> int:
    """Bytes held beyond ``before``, waiting up to ``settle_s`` for them to come back within
    ``slack``: the server's threads may still be releasing a request whose response the client
    already has. A leak stays up."""
    deadline = time.monotonic() + settle_s
    while (grown := held_bytes() - before) >= slack and time.monotonic() < deadline:
        time.sleep(0.1)
    return grown


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _mallinfo2():
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2  # glibc 2.33 or later
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()
