"""What the server attack tests (rounds three and four) share: the tiny model's name and answer
length, a live server over a module's ``engine`` fixture, a good request and the in-process answer
it must get under attack, and the process's resident memory."""

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


def rss_bytes() -> int:
    """This process's resident bytes, after a garbage collection and after glibc hands back the
    free memory at the top of its arenas: what the attacks' objects still hold, not what the
    allocator keeps cached (which threads' arenas a burst of bodies lands in varies from run to
    run; a 7 MB body's arenas alone had made the check fail one run in three) nor what a refused
    request's traceback cycles hold until the next collection."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def rss_growth(before: int, slack: int, settle_s: float = 3.0) -> int:
    """Resident bytes gained since ``before``, waiting up to ``settle_s`` for them to come back
    within ``slack``: the server's threads may still be releasing a request whose response the
    client already has (one 7 MB message of four came back 76 MB up at once). A leak stays up."""
    deadline = time.monotonic() + settle_s
    while (grown := rss_bytes() - before) >= slack and time.monotonic() < deadline:
        time.sleep(0.1)
    return grown


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: resident bytes as they are
        return None


_LIBC = _libc()
