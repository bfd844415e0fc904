"""Fixtures: a tiny random engine (milliseconds to build) and a small in-memory vector store that
ranks with the bundled all-MiniLM-L6-v2, so which document comes first means something."""

from __future__ import annotations

import inspect

import pytest
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.testing import make_model, make_tokenizer
from langchain_cacheblend import LocalSentenceTransformerEmbeddings

# Texts outside the tiny tokenizer's training sentences (so they take many tokens): the context
# dominates the prompt, as in real RAG, and the recompute fraction reflects the blending.
FACTS = [
    "The River Thames flows for 346 kilometres through southern England, from the Cotswolds "
    "through Oxford, Reading and Windsor, and reaches the North Sea through London.",
    "Marie Curie was born in Warsaw in 1867 and moved to Paris in 1891. She won the Nobel Prize "
    "in Physics in 1903 and the Nobel Prize in Chemistry in 1911.",
    "The University of Cambridge was founded in 1209 by scholars who left Oxford after a dispute "
    "with the townspeople; the River Cam flows through the city.",
    "Pierre Curie was a French physicist born in Paris in 1859; the Curie temperature, above "
    "which a material loses its permanent magnetism, is named after him.",
]


@pytest.fixture
def tiny_engine(tmp_path):
    eng = CacheBlendEngine(make_model("llama"), make_tokenizer(), store=KVStore(tmp_path / "kv"), pipelined=False)
    yield eng
    eng.close()


@pytest.fixture
def deep_engine(tmp_path):
    # 12 thin layers: deep enough that the layers after CacheBlend's gradual filtering (which
    # recompute only ~15% of the chunk tokens) dominate, as in a real model.
    eng = CacheBlendEngine(make_model("llama", layers=12), make_tokenizer(), store=KVStore(tmp_path / "kv"), pipelined=False)
    yield eng
    eng.close()


@pytest.fixture
def documents() -> list[Document]:
    return [Document(page_content=t, metadata={"source": f"fact-{i}", "n": i}) for i, t in enumerate(FACTS)]


@pytest.fixture(scope="session")
def minilm() -> LocalSentenceTransformerEmbeddings:
    # Loaded once (about a second): real sentence embeddings, so the tests can check the ranking.
    return LocalSentenceTransformerEmbeddings()


@pytest.fixture
def vectorstore(documents, minilm) -> InMemoryVectorStore:
    store = InMemoryVectorStore(minilm)
    store.add_documents(documents)
    return store


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Mark coroutine tests for pytest-asyncio (strict mode in this repo).

    LangChain's standard suites contain ``async def`` tests and forbid overriding them, so the
    marker is added here, before pytest-asyncio (an outer hook wrapper) turns them into async items.
    """
    outcome = yield
    if not inspect.iscoroutinefunction(obj):
        return
    result = outcome.get_result()
    for node in result if isinstance(result, list) else [result]:
        if isinstance(node, pytest.Function) and node.get_closest_marker("asyncio") is None:
            node.add_marker(pytest.mark.asyncio)
