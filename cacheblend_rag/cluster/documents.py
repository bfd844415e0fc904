"""What the router keys on: the documents of an OpenAI request, as short digests.

The front reads a request's body once, finds its documents exactly as the server does
(``server.inputs``: the ``documents`` field or flagged content parts) and forwards their digests
with the request. A digest names a document's text, not its chunk cache (that key needs the
model's tokenizer, which the front does not load): the same text gives the same chunk cache on
every replica of one model, so the text is what affinity needs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence

__all__ = ["digest", "digests", "request_documents"]

log = logging.getLogger(__name__)


def digest(text: str) -> str:
    """A document's routing name: 16 hex digits of its BLAKE2b hash (a collision only misroutes)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, person=b"cbrag-route").hexdigest()


def digests(documents: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(digest(d) for d in documents))


def request_documents(path: str, body: bytes) -> list[str]:
    """The documents of a chat or completions request body; [] for any other path, a body that
    is not a valid request (the replica's server answers it with its 400) or one without documents."""
    kind = (
        "chat"
        if path.rstrip("/").endswith("/chat/completions")
        else "completion"
        if path.rstrip("/").endswith("/completions")
        else None
    )
    if kind is None or not body:
        return []
    try:
        from cacheblend_rag.server.inputs import chat_request, completion_request
        from cacheblend_rag.server.schemas import ChatCompletionRequest, CompletionRequest

        data = json.loads(body)
        if kind == "chat":
            request = chat_request(ChatCompletionRequest.model_validate(data))
        else:
            request = completion_request(CompletionRequest.model_validate(data))
    except Exception as exc:  # noqa: BLE001 - routing is a preference: the replica reports the error
        log.debug("no documents to route by (%s): %r", path, exc)
        return []
    return list(request.chunks)
