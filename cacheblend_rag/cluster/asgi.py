"""A request forwarded from the front to a replica, and the replica's in-process call of its app.

The front reads the HTTP request once and sends it whole (:class:`ForwardedRequest`); the replica
runs it through its own OpenAI-compatible app (``server.create_app``, the app ``serve`` runs)
without a socket, and streams the app's ASGI messages back as they come, so a streamed answer
reaches the client token by token and errors keep the app's status and body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ForwardedRequest", "call_app"]


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the front received it. ``digests``: its documents' routing names
    (``cluster.documents``), read by the request router."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    digests: tuple[str, ...] = field(default=())


_END = object()


async def call_app(app: Any, req: ForwardedRequest, *, client: tuple[str, int] = ("127.0.0.1", 0)) -> AsyncIterator[dict]:
    """``app``'s ASGI messages (``http.response.start``, then ``http.response.body`` parts) for
    ``req``. Closing the iterator early is the client leaving: the app sees ``http.disconnect``,
    which stops the answer it is producing."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode("utf-8"),
        "query_string": req.query,
        "root_path": "",
        "headers": [tuple(h) for h in req.headers],
        "client": client,
        "server": ("127.0.0.1", 0),
        "state": {},
    }
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()  # the app listens for a disconnect while it answers
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(_END)

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await out.get()
            if message is _END:
                break
            yield message
        await task  # re-raises what the app raised outside a response
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            task.cancel()
