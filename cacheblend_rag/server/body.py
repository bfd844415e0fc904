"""A request's JSON body, parsed and validated without stalling the event loop for long.

``json.loads`` holds the interpreter for the whole of a body, 0.2 s for a 6 MB schema of 200,000
properties on a 2-core CPU, and no other thread can run meanwhile, so a worker thread would not
help. Parsed as FastAPI parses a declared body, four such bodies at once would be parsed back to
back and keep ``/health`` and every other request waiting behind all four (1.3 s measured). Here
large bodies are parsed one at a time, and after each the loop is left to everything else for
:data:`BREATHER_S`: a request that arrives during a large parse waits for that one parse, not for
the queue. Small bodies (every ordinary request) are parsed at once and never queue behind large
ones.

Errors are FastAPI's :class:`RequestValidationError` with FastAPI's locations (``("body",
offset)`` for malformed JSON, ``("body", field, ...)`` for a field), so one handler words them.
"""

from __future__ import annotations

import asyncio
import email.message
import json
from typing import TypeVar

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

LOOP_PARSE_BYTES = 256 * 2**10
"""Bodies up to this size are parsed at once (a millisecond or so); larger ones queue."""
BREATHER_S = 0.05
"""Seconds the loop serves other requests after each large parse, before the next one."""


class BodyParser:
    """Parses request bodies into pydantic models; one per app (it holds the large-body queue)."""

    def __init__(self) -> None:
        self._large = asyncio.Semaphore(1)

    async def parse(self, http: HTTPRequest, model: type[M]) -> M:
        _require_json(http.headers.get("content-type"))
        # Read here rather than with http.body(), which keeps the bytes on the request until the
        # response is sent: a refused megabyte body is let go as soon as it is parsed.
        raw = b"".join([chunk async for chunk in http.stream()])
        if len(raw) <= LOOP_PARSE_BYTES:
            return validate(raw, model)
        async with self._large:
            try:
                return validate(raw, model)
            finally:
                await asyncio.sleep(BREATHER_S)


def validate(raw: bytes, model: type[M]) -> M:
    """``raw`` (a JSON body) as ``model``, or FastAPI's RequestValidationError."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([error | {"ctx": {"error": exc.msg}}]) from None
    except UnicodeDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.start), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([error | {"ctx": {"error": "the body is not UTF-8"}}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([e | {"loc": ("body", *e["loc"])} for e in errors]) from None


def _require_json(content_type: str | None) -> None:
    # As FastAPI's strict_content_type: a form or text body is not read as JSON by accident.
    message = email.message.Message()
    message["content-type"] = content_type or ""
    subtype = message.get_content_subtype()
    if message.get_content_maintype() != "application" or not (subtype == "json" or subtype.endswith("+json")):
        raise RequestValidationError(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "msg": f"the body must be JSON sent with content-type: application/json, not {content_type or 'no content-type'}",
                    "input": None,
                }
            ]
        )
