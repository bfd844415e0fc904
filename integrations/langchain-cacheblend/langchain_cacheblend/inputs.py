"""Explicit, structured inputs: a question plus its retrieved documents, each kept as its own chunk.

Three equivalent ways to hand the models chunks explicitly:

* a dict ``{"question": str, "context": [Document | str, ...]}`` passed to ``invoke``/``stream``
  (``"input"``/``"query"`` are accepted for the question, ``"documents"``/``"docs"`` for the list);
* a :class:`RAGPromptValue` (what :func:`create_cacheblend_rag_chain` builds);
* for chat models, a ``HumanMessage`` whose content is a list of text blocks, one per chunk,
  each flagged ``block["extras"]["cacheblend_chunk"] = True`` (see :func:`chunk_block`), with
  the remaining unflagged text (normally the last block) as the question.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.prompt_values import PromptValue

from cacheblend_rag.chat.messages import CHUNK_FLAG, chunk_part, is_chunk_part  # noqa: F401 (CHUNK_FLAG re-exported)

QUESTION_KEYS = ("question", "input", "query")
CONTEXT_KEYS = ("context", "documents", "docs")


def as_document(item: Document | str) -> Document:
    if isinstance(item, Document):
        return item
    if isinstance(item, str):
        return Document(page_content=item)
    raise TypeError(f"a retrieved chunk must be a Document or a str, got {type(item).__name__}")


def chunk_block(item: Document | str) -> dict[str, Any]:
    """A chat content block that carries one retrieved chunk (its metadata travels in ``extras``)."""
    doc = as_document(item)
    return chunk_part(doc.page_content, doc.metadata)


# A chunk block is the core's chunk part: the HTTP server reads the same flag.
is_chunk_block = is_chunk_part


def rag_message(question: str, documents: Sequence[Document | str]) -> HumanMessage:
    """One user message: a flagged text block per document, then the question as the last block.

    A blank document (an empty page from a loader) holds nothing to read and is left out, as
    :class:`~langchain_cacheblend.CacheBlendLLM` leaves it out of its chunks: the engine refuses
    empty chunks, which would fail the whole chain over one empty page."""
    blocks = [chunk_block(d) for d in documents if as_document(d).page_content.strip()]
    return HumanMessage(content=blocks + [{"type": "text", "text": question}])


class ChunkedText(str):
    """The text of a :class:`RAGPromptValue` that still knows its question and documents.

    BaseLLM hands ``_generate``/``_stream`` only strings; this one reaches them unchanged (the LLM
    cache keys on its text), so :class:`~langchain_cacheblend.CacheBlendLLM` takes the documents as
    its chunks instead of finding them again in the text, which ``match_chunks=False`` or another
    registered chunk inside the question would defeat.
    """

    question: str
    chunks: tuple[str, ...]

    @classmethod
    def of(cls, question: str, chunks: Sequence[str]) -> ChunkedText:
        text = cls("\n\n".join([*chunks, question]))
        text.question, text.chunks = question, tuple(chunks)
        return text


class RAGPromptValue(PromptValue):
    """A question and its documents, kept apart until the model sees them.

    ``to_messages()`` gives :func:`rag_message` (chat models read the chunk blocks);
    ``to_string()`` gives the documents joined by blank lines followed by the question, which any
    LLM can read: a :class:`ChunkedText`, from which :class:`~langchain_cacheblend.CacheBlendLLM`
    takes the documents as its chunks.
    """

    question: str
    documents: list[Document]

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False  # not in LangChain's load() namespace

    @classmethod
    def from_input(cls, data: Mapping[str, Any]) -> RAGPromptValue:
        question = next((data[k] for k in QUESTION_KEYS if k in data), None)
        docs = next((data[k] for k in CONTEXT_KEYS if k in data), None)
        if not isinstance(question, str) or docs is None:
            raise ValueError(
                f"a dict input needs a 'question' str and a 'context' list of Documents or strings, got keys {sorted(data)}"
            )
        if isinstance(docs, str) or not isinstance(docs, Sequence):
            raise TypeError(
                "'context' must be a list of Documents or strings (one per retrieved chunk), got "
                f"{type(docs).__name__}; do not join the documents into one string"
            )
        return cls(question=question, documents=[as_document(d) for d in docs])

    @property
    def chunks(self) -> list[str]:
        return [d.page_content for d in self.documents]

    def to_string(self) -> str:
        return ChunkedText.of(self.question, self.chunks)

    def to_messages(self) -> list[BaseMessage]:
        return [rag_message(self.question, self.documents)]
