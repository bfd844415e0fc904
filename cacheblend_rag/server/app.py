"""The FastAPI application: OpenAI's chat and completions endpoints over one CacheBlendEngine.

``create_app(engine)`` builds it without opening a socket (serve it with uvicorn, or drive it
with a test client). Every request is a :class:`~cacheblend_rag.serving.Run` on the engine's
:class:`~cacheblend_rag.serving.Batcher`, admitted by the :class:`~.worker.EngineWorker`: up to
``max_batch`` answers share each decode step, ``max_queue`` more wait. Errors use
OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` so OpenAI clients raise their
usual exceptions with the message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from cacheblend_rag.server.body import BodyParser
from cacheblend_rag.server.inputs import chat_request, completion_request, message_chars, start_run
from cacheblend_rag.server.limits import BodyLimit
from cacheblend_rag.server.outputs import DONE, ChatFormat, CompletionFormat, sse
from cacheblend_rag.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    GenerationRequest,
    Health,
    ModelCard,
    ModelList,
)
from cacheblend_rag.server.settings import ServerConfig
from cacheblend_rag.server.worker import EngineWorker, Job, Overloaded
from cacheblend_rag.serving import Request

log = logging.getLogger(__name__)
T = TypeVar("T")


def _over_limit(what: str, limit: int, setting: str, param: str, fix: str) -> APIError:
    return APIError(
        400,
        f"invalid request: {what}, more than this server's limit of {limit} ({setting}, --{setting.replace('_', '-')}): {fix}",
        param=param,
        code="limit_exceeded",
    )


def check_limits(config: ServerConfig, stops: list[str], documents: tuple[str, ...], text_chars: int = 0) -> None:
    """Refuse (400, naming the limit and its setting) what would make one request expensive.
    ``text_chars``: the request's own text outside its documents (``inputs.message_chars``).
    Constant work per item, on the event loop; what grows with a value's structure (schemas,
    tools) is checked off it (``cacheblend_rag.bounds``, when the run is built)."""
    if text_chars > config.max_message_chars:
        raise _over_limit(
            f"the messages, tool calls and prompt hold {text_chars} characters",
            config.max_message_chars,
            "max_message_chars",
            "messages",
            "send the long texts as documents, or shorten them",
        )
    if len(stops) > config.max_stop_strings:
        raise _over_limit(f"stop has {len(stops)} strings", config.max_stop_strings, "max_stop_strings", "stop", "send fewer")
    for i, s in enumerate(stops):
        if len(s) > config.max_stop_chars:
            raise _over_limit(
                f"stop string {i} is {len(s)} characters", config.max_stop_chars, "max_stop_chars", "stop", "shorten it"
            )
    if len(documents) > config.max_documents:
        raise _over_limit(f"{len(documents)} documents", config.max_documents, "max_documents", "documents", "retrieve fewer")
    for i, d in enumerate(documents):
        if len(d) > config.max_document_chars:
            fix = "split it into shorter chunks"
            raise _over_limit(
                f"document {i} is {len(d)} characters", config.max_document_chars, "max_document_chars", "documents", fix
            )


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.info = status, ErrorInfo(message=message, type=type, param=param, code=code)


def create_app(engine, config: ServerConfig | None = None, *, close_engine: bool = False) -> FastAPI:
    """An OpenAI-compatible app over ``engine`` (a ``CacheBlendEngine``). Closing the app (its
    lifespan's end, e.g. uvicorn's graceful shutdown) waits for queued requests; then, with
    ``close_engine``, it closes the engine too (its learned neighbours saved, the store's
    write-backs finished and the store closed), and sets ``app.state.engine_closed``. Without it
    the engine is the caller's to close. ``app.state.batcher`` is the batcher serving it (its
    ``steps`` and ``rows_stepped`` count decode steps and the answers they advanced).

    Pass ``close_engine=True`` where uvicorn runs in the main thread (``uvicorn.run``,
    ``Server.run``): on SIGTERM uvicorn drains (``timeout_drain_s``), runs the lifespan's end,
    and then raises the signal again, which kills the process before any code after ``run``."""
    config = config or ServerConfig()
    name = config.model_name or engine.model_id
    if config.learn_neighbours:
        # A request's own chunks are the evidence of which chunks precede which (no corpus here).
        engine.learn_neighbours()
    worker = EngineWorker(engine, config.max_queue, config.max_batch)
    bodies = BodyParser()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn has let every open request finish (or cancelled it after timeout_drain_s) by
        # now; wait for the worker to drain too.
        await asyncio.to_thread(worker.close)
        if close_engine:
            await asyncio.to_thread(engine.close)
            app.state.engine_closed = True

    app = FastAPI(title="cacheblend-rag", lifespan=lifespan)
    app.state.server_config = config  # read by limits.uvicorn_config
    app.state.batcher = worker.batcher
    app.state.engine_closed = False
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.timeout_body_s)
    _install_error_handlers(app)

    def check_model(requested: str) -> None:
        if requested != name:
            raise APIError(
                404,
                f"The model {requested!r} does not exist: this server serves {name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def answer(body: GenerationRequest, request: Request, fmt: ChatFormat | CompletionFormat, http: HTTPRequest):
        check_limits(config, body.stops, request.chunks, message_chars(body))
        try:
            # Built on the job's relay thread: tokenizing a large request does not hold the loop.
            job = worker.submit(lambda: start_run(engine, body, request, worker.batcher))
        except Overloaded as exc:
            raise APIError(503, str(exc), type="server_error", code="overloaded") from None
        if not body.stream:
            await _while_connected(http, _drain(job))
            return fmt.whole(job.result, job.parsed)
        return await _event_stream(job, fmt, http)

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        running, waiting = worker.load()
        return Health(
            status="ok",
            model=name,
            running=running,
            waiting=waiting,
            admitted=worker.admitted,
            max_batch=worker.max_batch,
            max_queue=worker.max_queue,
            decode_steps=worker.batcher.steps,
            decoded_tokens=worker.batcher.rows_stepped,
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=started)])

    @app.get("/v1/models/{model:path}", response_model=ModelCard)
    async def model(model: str) -> ModelCard:
        check_model(model)
        return ModelCard(id=name, created=started)

    # The bodies are read here, not declared as parameters: FastAPI would parse a megabyte body
    # on the event loop (see .body).
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(http: HTTPRequest) -> Any:
        body = await bodies.parse(http, ChatCompletionRequest)
        check_model(body.model)
        return await answer(body, chat_request(body), ChatFormat(name, body.include_usage), http)

    @app.post("/v1/completions", response_model=None)
    async def completions(http: HTTPRequest) -> Any:
        body = await bodies.parse(http, CompletionRequest)
        check_model(body.model)
        return await answer(body, completion_request(body), CompletionFormat(name, body.include_usage), http)

    return app


async def _drain(job: Job[Any]) -> None:
    async for _ in job:
        pass


async def _first(deltas: AsyncIterator[str]) -> str | None:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None


async def _while_connected(http: HTTPRequest, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled, which
    leaves the job it iterates (a waiting request is never prefilled, a running one leaves the
    batch before the next decode step), and :class:`ClientDisconnect` is raised. Nothing else
    notices a client that gives up (a timeout) before the response starts: uvicorn does not cancel
    the handler, and the answer would take its row of the batch to its end."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()  # no-op once done; also when this handler is cancelled itself
        gone.cancel()
    if task not in done:
        raise ClientDisconnect()
    return task.result()


async def _disconnected(http: HTTPRequest) -> None:
    # The body has been read, so the next message is the disconnect.
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _event_stream(job: Job[str], fmt: ChatFormat | CompletionFormat, http: HTTPRequest) -> StreamingResponse:
    """An SSE response. The first token is awaited before answering, so a request the engine
    refuses (too long, bad sampling values) still gets its 4xx instead of a broken stream.
    Once streaming, the response itself stops the job when the client disconnects."""
    deltas = aiter(job)
    first = await _while_connected(http, _first(deltas))

    async def events() -> AsyncIterator[str]:
        try:
            opening = fmt.opening()
            if opening is not None:
                yield sse(opening)
            if first is not None:
                yield sse(fmt.delta(first))
            async for delta in deltas:
                yield sse(fmt.delta(delta))
            for chunk in fmt.closing(job.result, job.parsed):
                yield sse(chunk)
        except Exception as exc:  # the 200 is sent already: report in the stream, as OpenAI does
            log.exception("request failed while streaming")
            yield sse(ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error")))
        finally:
            await deltas.aclose()  # a client gone: stop generating
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")


def _install_error_handlers(app: FastAPI) -> None:
    def reply(status: int, info: ErrorInfo, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return reply(exc.status, exc.info)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            # Its loc is ("body", character offset): a position, not a field to name as param.
            err = errors[0]
            where = err["loc"][1] if len(err.get("loc", ())) > 1 else "?"
            reason = (err.get("ctx") or {}).get("error", "JSON decode error")
            return reply(
                400,
                ErrorInfo(
                    message=f"invalid request: the body is not valid JSON: {reason} (at character {where})",
                    type="invalid_request_error",
                ),
            )
        problems = []
        for err in errors:
            where = ".".join(str(p) for p in err.get("loc", ())[1:])  # drop the leading "body"
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"{where}: {msg}" if where else msg)
        first_loc = errors[0].get("loc", ()) if errors else ()
        param = str(first_loc[1]) if len(first_loc) > 1 else None
        return reply(400, ErrorInfo(message="invalid request: " + "; ".join(problems), type="invalid_request_error", param=param))

    @app.exception_handler(ValueError)
    async def refused(_: HTTPRequest, exc: ValueError) -> JSONResponse:
        # What the engine and the request mapping raise for input they cannot answer.
        return reply(400, ErrorInfo(message=str(exc), type="invalid_request_error"))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: HTTPRequest, exc: ClientDisconnect) -> Response:
        log.info("the client disconnected before its answer was sent: stopped it")
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(HTTPException)
    async def http_error(_: HTTPRequest, exc: HTTPException) -> JSONResponse:
        # Starlette's own headers (a 405's Allow) belong to the answer: HTTP requires Allow on a 405.
        return reply(exc.status_code, ErrorInfo(message=str(exc.detail), type="invalid_request_error"), exc.headers)

    @app.exception_handler(Exception)
    async def failed(_: HTTPRequest, exc: Exception) -> JSONResponse:
        log.error("request failed", exc_info=exc)
        return reply(500, ErrorInfo(message=f"the engine failed: {type(exc).__name__}: {exc}", type="server_error"))
