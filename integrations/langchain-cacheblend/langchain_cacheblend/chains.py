"""``create_cacheblend_rag_chain``: the recommended LCEL chain, documents passed as separate chunks."""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate, PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel

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
    ``return_source_documents=True`` a dict ``{"question", "documents", "answer"}``.
    """
    if not isinstance(retriever, CacheBlendRetriever):
        retriever = CacheBlendRetriever(retriever=retriever, llm=llm)
    template: BasePromptTemplate | None = PromptTemplate.from_template(prompt) if isinstance(prompt, str) else prompt
    if template is not None and "context" in template.input_variables:
        raise ValueError(
            "the prompt formats the question turn only; drop {context}: the documents are passed "
            "to the model as separate chunks"
        )

    def to_prompt(inputs: dict[str, Any]) -> RAGPromptValue:
        question = inputs["question"]
        if template is not None:
            question = template.invoke({"question": question}).to_string()
        docs: list[Document] = inputs["documents"]
        return RAGPromptValue(question=question, documents=docs)

    question = RunnableLambda(_question)
    gather = RunnableParallel(question=question, documents=question | retriever)
    chain = gather.assign(answer=RunnableLambda(to_prompt) | llm | StrOutputParser())
    if return_source_documents:
        return chain.with_config(run_name="cacheblend_rag_chain")
    return chain.pick("answer").with_config(run_name="cacheblend_rag_chain")
