"""API request bodies to engine requests (the question, its documents, or a plain chat)."""

from __future__ import annotations

from ..messages import split_messages
from ..serving import Request
from .schemas import ChatCompletionRequest, CompletionRequest


def chat_request(body: ChatCompletionRequest) -> Request:
    """Documents from the ``documents`` field or from flagged content parts (not both); the rest
    of the messages is the question. No documents: the messages as a plain chat. The request
    carries the body's settings, and a ``response_format`` schema's hint after the question."""
    return _chat(body).with_hint(body.structured()[1]).with_settings(**body.settings())


def completion_request(body: CompletionRequest) -> Request:
    """With ``documents``, the prompt is the question over them; without, it is one user turn of
    the model's chat template (as the LangChain and LlamaIndex LLMs answer a plain prompt)."""
    if body.documents:
        request = Request.over_chunks(body.text, body.documents)
    else:
        request = Request.plain_chat([{"role": "user", "content": body.text}], body.text)
    return request.with_hint(body.structured()[1]).with_settings(**body.settings())


def _chat(body: ChatCompletionRequest) -> Request:
    split = split_messages([(m.role, m.content) for m in body.messages])
    if body.documents and split.chunks:
        raise ValueError(
            "documents were passed both in the 'documents' field and as cacheblend_chunk content parts: use one of the two"
        )
    chunks = body.documents or split.chunks
    if chunks:
        return Request.over_chunks(split.question, chunks)
    return Request.plain_chat(split.messages, split.question)
