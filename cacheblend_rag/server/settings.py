"""How the server presents and protects its engine: :class:`ServerConfig`, read by the app
(``app.py``) and by the connection limits it installs (``limits.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """How the server presents and protects its engine (docs/server.md lists every limit).

    model_name: the name clients pass as ``model`` (None: the engine's ``model_id``). Any other
        name is answered 404 ``model_not_found``, as OpenAI does.
    max_batch: answers decoded together, one forward per token for all of them (default 8; 1:
        one answer at a time). Requests are prefilled one at a time as they arrive.
    max_queue: requests that may wait while ``max_batch`` run; one more gets 503 at once (default 8).
    learn_neighbours: learn neighbour-aware chunk caches from the traffic (default True;
        ``serve --no-neighbours`` turns it off): ``create_app`` calls ``engine.learn_neighbours()``,
        so after a request its chunks are also cached behind the chunks in front of them, in the
        background between requests (one chunk prefill behind up to 2 chunks per new cache, at most
        4 such caches per chunk), and later requests with those chunks use them. Answers come
        closer to full prefill's, but are no longer a function of the request alone: a request
        repeated after its learned caches exist may be answered differently, once. A learned cache
        serves only prompts that hold every chunk it was computed behind, so one client's documents
        never shape another client's answer (``NeighbourCache.serves``). False keeps every answer
        reproducible (it does not stop an engine that already learns).

    Request limits (one more is refused with 413 for the body, else 400, naming the limit):
    max_body_bytes: bytes of one request body (default 8 MiB).
    max_documents: documents of one request, from ``documents`` or chunk content parts (default 64).
    max_document_chars: characters of one document (default 100,000).
    max_stop_strings: stop strings of one request (default 16; OpenAI allows 4).
    max_stop_chars: characters of one stop string (default 256).
    max_message_chars: characters of a request's own text together, outside its documents: the
        messages' text, the tool calls' ids, names and arguments, a completion's prompt (default
        100,000, a document's limit). Tools, schemas and tool-call arguments are bounded besides by
        ``cacheblend_rag.bounds`` (nesting, values, characters), for the integrations too.

    Connections (uvicorn, through :func:`~.limits.uvicorn_config`):
    timeout_header_s: seconds a connection may take to send a request's headers, counted from
        its opening or the previous response; then it is closed (default 10).
    timeout_body_s: seconds a request's body may take to arrive; then 408 (default 30).
    timeout_keep_alive_s: seconds an idle keep-alive connection stays open (default 5, uvicorn's).
    max_connections: open connections; over it, the connections that have waited
        ``limits.SHED_GRACE_S`` (0.5 s) or more for their headers are closed, longest waiting
        first; past twice it, the longest waiting one whatever its age, or the new one if every
        other one is busy (default 128).
    max_header_bytes: bytes of a request's headers (h11's ``max_incomplete_event_size``; default
        16 KiB); more gets 400 from uvicorn.
    timeout_drain_s: seconds a graceful shutdown (SIGTERM, SIGINT) waits for open requests to
        finish; then they are cancelled and the server stops (default 30). ``serve`` closes its
        engine after the drain, in the app's lifespan shutdown (``create_app(close_engine=True)``).
    """

    model_name: str | None = None
    max_batch: int = 8
    max_queue: int = 8
    learn_neighbours: bool = True
    max_body_bytes: int = 8 * 2**20
    max_documents: int = 64
    max_document_chars: int = 100_000
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_message_chars: int = 100_000
    timeout_header_s: float = 10.0
    timeout_body_s: float = 30.0
    timeout_keep_alive_s: int = 5
    max_connections: int = 128
    max_header_bytes: int = 16 * 1024
    timeout_drain_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.learn_neighbours, bool):
            raise ValueError(f"ServerConfig.learn_neighbours={self.learn_neighbours!r} must be True or False")
        for name in (
            "max_batch",
            "max_body_bytes",
            "max_documents",
            "max_document_chars",
            "max_stop_strings",
            "max_stop_chars",
            "max_message_chars",
            "max_connections",
            "max_header_bytes",
            "timeout_keep_alive_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerConfig.{name}={value!r} must be an int >= 1")
        for name in ("timeout_header_s", "timeout_body_s", "timeout_drain_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"ServerConfig.{name}={value!r} must be a number of seconds > 0")
