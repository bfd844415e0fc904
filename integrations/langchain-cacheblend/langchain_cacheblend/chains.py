"""``create_cacheblend_rag_chain``: the recommended LCEL chain, documents passed as separate chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler, BaseCallbackManager
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import LLMResult
from langchain_core.prompts import BasePromptTemplate, PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableGenerator, RunnableLambda, RunnableParallel
from langchain_core.runnables.utils import AddableDict

from cacheblend_rag.blend.sources import STATS_KEY, attention_by_text

from ._base import CacheBlendParams
from .inputs import RAGPromptValue
from .retrievers import CacheBlendRetriever


def _question(inputs: Any) -> str:
    if isinstance(inputs, str):
        return inputs
    if isinstance(inputs, dict) and isinstance(inputs.get("question"), str):
        return inputs["question"]
    raise TypeError("the chain takes the question as a str or {'question': str}")


def create_cacheblend_rag_chain(
    retriever: BaseRetriever,
    llm: CacheBlendParams,
    prompt: str | BasePromptTemplate | None = None,
    *,
    return_source_documents: bool = False,
) -> Runnable:
    """Question in, answer out: retrieve, then hand the model each document as its own chunk.

    ``retriever`` is wrapped in :class:`CacheBlendRetriever` (sharing ``llm``'s registry) unless it
    already is one. ``prompt`` optionally formats the question turn only: a template with a
    ``{question}`` variable (no ``{context}``: the documents never pass through the template).
    The chain takes a str or ``{"question": str}`` and returns the answer string, or with
    ``return_source_documents=True`` a dict ``{"question", "documents", "answer",
    "chunk_attention"}``: ``chunk_attention[i]`` is ``documents[i]``'s share of the question's
    attention (``cacheblend_rag.blend.sources``; the shares sum to 1), None for a blank document or a
    repeat of an earlier one (the model read neither as a chunk of its own). The whole entry is
    None when the answer's mode does not measure it (``full_recompute``, ``prefix_caching``,
    ``full_reuse``, ``strategy="hkvd"``).
    """
    if not isinstance(retriever, CacheBlendRetriever):
        retriever = CacheBlendRetriever(retriever=retriever, llm=llm)
    template: BasePromptTemplate | None = PromptTemplate.from_template(prompt) if isinstance(prompt, str) else prompt
    if template is not None and "context" in template.input_variables:
        raise ValueError(
            "the prompt formats the question turn only; drop {context}: the documents are passed to the model as separate chunks"
        )

    def to_prompt(inputs: dict[str, Any]) -> RAGPromptValue:
        question = inputs["question"]
        if template is not None:
            question = template.invoke({"question": question}).to_string()
        docs: list[Document] = inputs["documents"]
        return RAGPromptValue(question=question, documents=docs)

    question = RunnableLambda(_question)
    gather = RunnableParallel(question=question, documents=question | retriever)
    if return_source_documents:
        return (gather | _answer_with_sources(llm, to_prompt)).with_config(run_name="cacheblend_rag_chain")
    chain = gather.assign(answer=RunnableLambda(to_prompt) | llm | StrOutputParser())
    return chain.pick("answer").with_config(run_name="cacheblend_rag_chain")


class _AnswerMetadata(BaseCallbackHandler):
    """Keeps the metadata of the model's answer (the engine's stats) when its run ends: a chat
    model's ``response_metadata``, an LLM's ``generation_info`` (a streamed LLM yields only text)."""

    def __init__(self) -> None:
        self.metadata: dict[str, Any] = {}

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        gen = response.generations[0][0] if response.generations and response.generations[0] else None
        message = getattr(gen, "message", None)
        if message is not None:
            self.metadata = dict(message.response_metadata)
        elif gen is not None:
            self.metadata = dict(gen.generation_info or {})


def _watched(config: RunnableConfig, handler: BaseCallbackHandler) -> RunnableConfig:
    """``config`` with ``handler`` among its callbacks (for this call only, not its children's)."""
    callbacks = config.get("callbacks")
    if isinstance(callbacks, BaseCallbackManager):
        callbacks = callbacks.copy()
        callbacks.add_handler(handler, inherit=False)
    else:
        callbacks = [*(callbacks or []), handler]
    return {**config, "callbacks": callbacks}


def _sources(documents: Sequence[Document], metadata: dict[str, Any]) -> list[float | None] | None:
    shares = metadata.get(STATS_KEY)
    return None if shares is None else attention_by_text([d.page_content for d in documents], shares)


def _answer_with_sources(llm: CacheBlendParams, to_prompt) -> Runnable:
    """The gathered question and documents passed on, the answer streamed as it is decoded, then
    each document's attention share."""

    def text(chunk: Any) -> str:
        return chunk.content if isinstance(chunk, BaseMessage) else chunk

    def answer(inputs: Iterator[dict], config: RunnableConfig) -> Iterator[AddableDict]:
        data = AddableDict()
        for part in inputs:
            data = data + AddableDict(part)
            yield AddableDict(part)
        seen = _AnswerMetadata()
        yield AddableDict(answer="")  # the key exists even for an empty answer
        for chunk in llm.stream(to_prompt(data), config=_watched(config, seen)):  # type: ignore[attr-defined]
            if text(chunk):
                yield AddableDict(answer=text(chunk))
        yield AddableDict(chunk_attention=_sources(data["documents"], seen.metadata))

    async def aanswer(inputs: AsyncIterator[dict], config: RunnableConfig) -> AsyncIterator[AddableDict]:
        data = AddableDict()
        async for part in inputs:
            data = data + AddableDict(part)
            yield AddableDict(part)
        seen = _AnswerMetadata()
        yield AddableDict(answer="")
        async for chunk in llm.astream(to_prompt(data), config=_watched(config, seen)):  # type: ignore[attr-defined]
            if text(chunk):
                yield AddableDict(answer=text(chunk))
        yield AddableDict(chunk_attention=_sources(data["documents"], seen.metadata))

    return RunnableGenerator(answer, aanswer, name="answer_with_sources")
