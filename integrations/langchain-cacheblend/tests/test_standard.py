"""LangChain's standard test suites for the chat model and the retriever wrapper."""

from __future__ import annotations

import functools

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from cacheblend_rag.testing import make_engine
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend


@functools.cache
def _engine():
    # One tiny engine for the whole suite: the standard tests build many model instances.
    return make_engine("llama")


class TestChatCacheBlendUnit(ChatModelUnitTests):
    # Tool calling and structured output are not supported (bind_tools is not overridden), so
    # the suite skips those tests by itself.
    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict:
        return {"engine": _engine()}


def make_retriever(k: int = 4) -> CacheBlendRetriever:
    """The wrapper over an InMemoryVectorStore retriever returning ``k`` documents."""
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


class TestChatCacheBlendIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict:
        return {"engine": _engine(), "max_tokens": 8}
