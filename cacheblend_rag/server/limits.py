"""What one client may ask of the server: request sizes, connection counts and timeouts.

The server answers one request at a time, so anything a single request can make expensive (a
huge body, thousands of stop strings, megabyte documents) or a single client can hold (idle or
slow connections) is bounded here, and refused with OpenAI's error body naming the limit.

* :class:`BodyLimit` (ASGI middleware): a body over ``max_body_bytes`` is refused with 413 before
  it is read (its Content-Length) or as soon as it grows past the limit (a chunked body), and a
  body that does not arrive within ``timeout_body_s`` gets 408. Nothing past the limit is kept.
* :func:`guarded_protocol`: uvicorn's h11 protocol with a deadline for a request's headers (a
  fresh connection that sends nothing, or headers one byte a second, is closed after
  ``timeout_header_s``) and a cap on open connections that closes connections still waiting for
  their headers, longest waiting first, so idle connections cannot lock a working client out.
  A connection is closed for the cap only once it has waited :data:`SHED_GRACE_S` for its
  headers, unless twice ``max_connections`` are open: a client that has just connected and is
  sending its request is not mistaken for an idle one during a burst of idle connections.
* :func:`uvicorn_config`: uvicorn's own settings (keep-alive timeout, header size) from the
  :class:`~.config.ServerConfig`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import uvicorn
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from cacheblend_rag.server.settings import ServerConfig

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def error_body(message: str, param: str | None = None, code: str | None = None) -> bytes:
    """OpenAI's error body, for answers sent before the app (and its handlers) sees the request."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}).encode()


class BodyRefused(HTTPException):
    """Raised from ``receive``: FastAPI lets an HTTPException out of its body parsing (any other
    exception becomes a vague 400), and the app's handler answers it in OpenAI's error shape."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message, headers={"connection": "close"})


class BodyLimit:
    """ASGI middleware: refuses bodies over ``max_bytes`` (413) and bodies slower than
    ``timeout_s`` (408), for every HTTP request."""

    def __init__(self, app: Callable, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.too_large = (
            f"the request body is larger than this server's limit of {max_bytes} bytes "
            "(max_body_bytes, --max-body-bytes): send fewer or shorter documents"
        )
        self.too_slow = (
            f"the request body did not arrive within {timeout_s:g} s (timeout_body_s, --timeout-body): "
            "send the whole body at once"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _reply(
                    send, 400, error_body("invalid request: the Content-Length header is not a number"), close=True
                )
            if declared > self.max_bytes:
                # Refused unread: the body's bytes are discarded as they arrive (memory stays flat)
                # until it ends or its time is up. Closing with the body still arriving would make
                # the kernel reset the connection, and the client could lose the 413 itself.
                await self._discard_body(receive)
                return await _reply(send, 413, error_body(self.too_large, code="request_too_large"), close=True)
        deadline = time.monotonic() + self.timeout_s
        received = 0

        async def limited_receive() -> Message:
            nonlocal received, deadline
            if deadline == float("inf"):  # the body is in: only the disconnect is left to wait for
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise BodyRefused(408, self.too_slow) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyRefused(413, self.too_large)
                if not message.get("more_body", False):
                    deadline = float("inf")
            return message

        await self.app(scope, limited_receive, send)

    async def _discard_body(self, receive: Receive) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


async def _reply(send: Send, status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


SHED_GRACE_S = 0.5
"""Seconds a connection must have waited for its request's headers before the connection cap may
close it (below twice ``max_connections`` open). A working client sends its headers within
milliseconds of connecting; an idle one sends nothing for seconds."""


def guarded_protocol(timeout_header_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline and a connection cap (see the module doc).

    uvicorn's own ``timeout_keep_alive`` only starts after a response, so a connection that never
    sends a request, or sends its headers slowly, is never closed; and its ``limit_concurrency``
    counts idle connections, so idle connections would make it answer a working client 503.

    The cap, each time a connection opens with more than ``max_connections`` open: connections
    waiting for their headers for at least :data:`SHED_GRACE_S` are closed, longest waiting
    first, until ``max_connections`` are open. Younger ones are left alone, so a client whose
    request is on its way is never closed for the cap, up to ``2 * max_connections`` open; past
    that the longest waiting connection is closed whatever its age, or the new one if every other
    one is busy with a request. (Closing a connection as it connects, before its request has been
    read, resets a working client: 15 in 1,000 during bursts of 24 idle connections over a cap of
    16, tests/test_reliability_round4.py::test_good_requests_are_answered_while_idle_connections_churn.)
    """
    hard_cap = 2 * max_connections
    sweep: dict[str, asyncio.TimerHandle | None] = {"timer": None}  # one per server

    def shed(connections: set[Any], new: Any = None) -> None:
        now = time.monotonic()
        open_ = [c for c in connections if not c.transport.is_closing()]
        waiting = sorted(
            (c for c in open_ if c is not new and getattr(c, "_waiting_for_headers", lambda: False)()),
            key=lambda c: c._waiting_since,
        )
        over = len(open_) - max_connections
        victims = [c for c in waiting if now - c._waiting_since >= SHED_GRACE_S][: max(over, 0)]
        if new is not None and len(open_) - len(victims) > hard_cap:
            young = [c for c in waiting if c not in victims]
            victims.append(young[0] if young else new)
        if victims:
            log.warning(
                "%d connections open (max_connections %d): closing %d waiting for their headers%s",
                len(open_),
                max_connections,
                len(victims),
                " (the new one)" if new in victims else "",
            )
        for victim in victims:
            victim._close()
        young = [c for c in waiting if c not in victims]
        if len(open_) - len(victims) > max_connections and young and sweep["timer"] is None:
            # Still over the cap: look again when the longest waiting one's grace is over.
            delay = max(0.0, young[0]._waiting_since + SHED_GRACE_S - now) + 0.01
            sweep["timer"] = young[0].loop.call_later(delay, swept, connections)

    def swept(connections: set[Any]) -> None:
        sweep["timer"] = None
        shed(connections)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._waiting_since = time.monotonic()
            self._header_timer: asyncio.TimerHandle | None = None
            self._arm_header_timer()
            if len(self.connections) > max_connections:
                shed(self.connections, self)

        def _waiting_for_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout_header_s, self._header_deadline)

        def _header_deadline(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers():
                log.info("closing a connection that sent no complete request headers within %g s", timeout_header_s)
                self._close()

        def _close(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._waiting_since = time.monotonic()
            self._arm_header_timer()  # the next request's headers get the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_settings(config: ServerConfig) -> dict[str, Any]:
    """uvicorn's settings (``uvicorn.run``/``uvicorn.Config`` keyword arguments) for ``config``'s
    connection limits and timeouts."""
    return {
        "http": guarded_protocol(config.timeout_header_s, config.max_connections),
        "timeout_keep_alive": config.timeout_keep_alive_s,
        "h11_max_incomplete_event_size": config.max_header_bytes,
        # uvicorn waits for open requests without end by default: a SIGTERM must stop the server.
        "timeout_graceful_shutdown": config.timeout_drain_s,
    }


def uvicorn_config(app: Any, config: ServerConfig | None = None, **kwargs: Any) -> uvicorn.Config:
    """A ``uvicorn.Config`` for ``app`` with the limits and timeouts of ``config`` (default: the
    one ``create_app`` stored on the app). ``kwargs`` go to uvicorn (host, port, log_level, ...)."""
    config = config or getattr(getattr(app, "state", None), "server_config", None) or ServerConfig()
    return uvicorn.Config(app, **uvicorn_settings(config), **kwargs)
