"""CacheBlendRetriever, precompute_vectorstore and the one-line chain helper."""

from __future__ import annotations

import pytest

from cacheblend_rag.engine.capacity import StoreTooSmall
from langchain_cacheblend import (
    CacheBlendLLM,
    CacheBlendRetriever,
    ChatCacheBlend,
    ChunkRegistry,
    create_cacheblend_rag_chain,
    precompute_vectorstore,
)

QUESTION = "Who won two Nobel prizes?"


def test_documents_pass_through_unchanged_and_are_registered(tiny_engine, vectorstore):
    inner = vectorstore.as_retriever(search_kwargs={"k": 3})
    llm = CacheBlendLLM(engine=tiny_engine)
    wrapped = CacheBlendRetriever(retriever=inner, llm=llm)
    got = wrapped.invoke(QUESTION)
    assert got == inner.invoke(QUESTION)  # same order, ids, metadata
    assert got[0].metadata["source"] == "fact-1"  # Marie Curie's two prizes rank first
    assert all(d.page_content in llm.chunk_registry for d in got)
    # The registry is the engine's shared one: a second model on the engine sees the chunks.
    assert all(d.page_content in ChatCacheBlend(engine=tiny_engine).chunk_registry for d in got)
    assert not any(tiny_engine.is_cached(d.page_content) for d in got)  # precompute=False


def test_precompute_sync_and_background(tiny_engine, vectorstore):
    inner = vectorstore.as_retriever(search_kwargs={"k": 2})
    docs = CacheBlendRetriever(retriever=inner, engine=tiny_engine, precompute="sync").invoke(QUESTION)
    assert all(tiny_engine.is_cached(d.page_content) for d in docs)
    bg = CacheBlendRetriever(
        retriever=vectorstore.as_retriever(search_kwargs={"k": 4}), engine=tiny_engine, precompute="background"
    )
    docs = bg.invoke("Thames")
    bg.wait()
    tiny_engine.flush()
    assert len(docs) == 4 and all(tiny_engine.is_cached(d.page_content) for d in docs)


def test_wrapper_needs_a_model():
    from langchain_core.retrievers import BaseRetriever

    class Empty(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager):
            return []

    with pytest.raises(ValueError, match="needs llm="):
        CacheBlendRetriever(retriever=Empty())
    with pytest.raises(ValueError, match="needs llm="):
        CacheBlendRetriever(retriever=Empty(), registry=ChunkRegistry(), precompute="sync")
    assert CacheBlendRetriever(retriever=Empty(), registry=ChunkRegistry()).invoke("x") == []


def test_precompute_vectorstore_and_document_lists(tiny_engine, vectorstore, documents):
    llm = CacheBlendLLM(engine=tiny_engine)
    # By default each document also gets a cache behind its 2 nearest documents; neighbours=0
    # computes the plain caches only, and learn=True has the engine learn neighbours as it answers.
    assert precompute_vectorstore(vectorstore, llm, batch_size=3, progress=False) == 2 * len(documents)
    assert tiny_engine.learner is None
    assert precompute_vectorstore(documents, tiny_engine, progress=False, learn=True) == 0
    assert tiny_engine.learner is not None and tiny_engine.learner.config.neighbours == 2
    assert all(tiny_engine.is_cached(d.page_content) and d.page_content in llm.chunk_registry for d in documents)
    assert precompute_vectorstore(documents, tiny_engine, progress=False) == 0  # already cached
    assert precompute_vectorstore(["A new fact about the river Cam."], tiny_engine, progress=False, neighbours=0) == 1
    with pytest.raises(ValueError, match="neighbours=-1 must be an int >= 0"):
        precompute_vectorstore(documents, tiny_engine, neighbours=-1)
    with pytest.raises(TypeError, match="not a single string"):
        precompute_vectorstore("text", tiny_engine)
    with pytest.raises(TypeError, match="CacheBlendLLM, ChatCacheBlend or CacheBlendEngine"):
        precompute_vectorstore(documents, object())


def test_precompute_vectorstore_refuses_a_collection_the_store_cannot_hold(tiny_engine, documents):
    # Planned over the whole collection before the first batch: nothing computed, nothing evicted.
    plan = tiny_engine.plan_precompute([d.page_content for d in documents])
    tiny_engine.store.size_limit = tiny_engine.store.bytes_needed(plan.total_bytes, plan.records) - 1
    with pytest.raises(StoreTooSmall, match=r"more than the store's size limit of [\d,]+ bytes"):
        precompute_vectorstore(documents, tiny_engine, neighbours=0, batch_size=1, progress=False)
    assert tiny_engine.store.stats.bytes_written == 0
    tiny_engine.store.size_limit = tiny_engine.store.bytes_needed(plan.total_bytes, plan.records)
    assert precompute_vectorstore(documents, tiny_engine, neighbours=0, batch_size=1, progress=False) == len(documents)
    assert tiny_engine.store.stats.bytes_written == plan.new_bytes


def test_create_cacheblend_rag_chain(tiny_engine, vectorstore):
    inner = vectorstore.as_retriever(search_kwargs={"k": 2})
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=5)
    chain = create_cacheblend_rag_chain(inner, chat, return_source_documents=True)
    out = chain.invoke({"question": QUESTION})
    docs = inner.invoke(QUESTION)
    assert out["documents"] == docs and out["question"] == QUESTION
    assert out["answer"] == tiny_engine.generate(QUESTION, [d.page_content for d in docs], max_new_tokens=5).text
    templated = create_cacheblend_rag_chain(
        inner, CacheBlendLLM(engine=tiny_engine, max_new_tokens=5), prompt="{question} Answer briefly."
    )
    ref = tiny_engine.generate(f"{QUESTION} Answer briefly.", [d.page_content for d in docs], max_new_tokens=5)
    assert templated.invoke(QUESTION) == ref.text
    with pytest.raises(ValueError, match="drop \\{context\\}"):
        create_cacheblend_rag_chain(inner, chat, prompt="{context} {question}")


def test_neighbour_aware_precompute_from_the_vectorstore_and_the_retriever(tiny_engine, vectorstore, documents):
    texts = [d.page_content for d in documents]
    # Plain caches plus one cache per document prefilled behind its most similar document.
    assert precompute_vectorstore(documents, tiny_engine, neighbours=1, progress=False) == 2 * len(texts)
    stats = tiny_engine.prefill(tiny_engine.build_layout(QUESTION, texts[:3]), "full_reuse").stats
    assert stats["neighbour_hits"] == 2  # every chunk but the first, which keeps its exact cache
    inner = vectorstore.as_retriever(search_kwargs={"k": 2})
    docs = CacheBlendRetriever(retriever=inner, engine=tiny_engine, precompute="sync", neighbours=1).invoke("Thames")
    assert docs[0].metadata["source"] == "fact-0"  # the Thames fact ranks first
    got = tiny_engine.prefill(tiny_engine.build_layout("Thames?", [d.page_content for d in docs]), "full_reuse").stats
    assert got["neighbour_hits"] == 1


def test_background_precompute_error_is_kept_for_wait(tiny_engine, vectorstore, monkeypatch, caplog):
    """wait() re-raises a failed background precompute even when later retrievals came first."""
    import time

    precompute = tiny_engine.precompute
    calls = []

    def fails_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk full")
        time.sleep(0.3)  # still running when wait() meets the first job's error
        out = precompute(*args, **kwargs)
        calls.append("done")
        return out

    monkeypatch.setattr(tiny_engine, "precompute", fails_first)
    bg = CacheBlendRetriever(
        retriever=vectorstore.as_retriever(search_kwargs={"k": 2}), engine=tiny_engine, precompute="background"
    )
    bg.invoke(QUESTION)
    deadline = time.monotonic() + 30
    while "background KV precompute failed" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the failed job has finished (it re-raises right after logging)
    bg.invoke("Thames")
    with pytest.raises(OSError, match="disk full"):
        bg.wait()
    assert calls[-1] == "done"  # the later job finished before wait() raised: nothing runs on unwatched
    bg.wait()  # reported once


def test_chain_maps_the_question_attention_onto_its_documents(tiny_engine, vectorstore):
    import asyncio

    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    inner = vectorstore.as_retriever(search_kwargs={"k": 3})
    docs = inner.invoke(QUESTION)
    tiny_engine.precompute([d.page_content for d in docs], progress=False)  # every call below reads stored caches
    ref = tiny_engine.generate(QUESTION, [d.page_content for d in docs], max_new_tokens=5)
    shares = ref.stats["chunk_attention"]
    assert len(shares) == 3 and sum(shares) == pytest.approx(1.0)
    for llm in (ChatCacheBlend(engine=tiny_engine, max_new_tokens=5), CacheBlendLLM(engine=tiny_engine, max_new_tokens=5)):
        chain = create_cacheblend_rag_chain(inner, llm, return_source_documents=True)
        out = chain.invoke(QUESTION)
        assert out["answer"] == ref.text and out["documents"] == docs
        assert out["chunk_attention"] == pytest.approx(shares)
        assert asyncio.run(chain.ainvoke(QUESTION))["chunk_attention"] == pytest.approx(shares)
        parts = list(chain.stream(QUESTION))
        assert "".join(p.get("answer", "") for p in parts) == ref.text  # the answer streams as decoded
        assert parts[-1] == {"chunk_attention": pytest.approx(shares)}
    # The chat model's own metadata carries the shares too, in the engine's chunk order.
    msg = ChatCacheBlend(engine=tiny_engine, max_new_tokens=5).invoke({"question": QUESTION, "context": docs})
    assert msg.response_metadata["chunk_attention"] == pytest.approx(shares)

    class Repeats(BaseRetriever):  # a blank page and a repeat: read as no chunk of their own
        def _get_relevant_documents(self, query, *, run_manager):
            return [docs[0], Document(page_content=" "), docs[1], docs[0]]

    out = create_cacheblend_rag_chain(
        Repeats(), ChatCacheBlend(engine=tiny_engine, max_new_tokens=5), return_source_documents=True
    ).invoke(QUESTION)
    two = tiny_engine.generate(QUESTION, [docs[0].page_content, docs[1].page_content], max_new_tokens=5).stats["chunk_attention"]
    assert out["chunk_attention"] == [pytest.approx(two[0]), None, pytest.approx(two[1]), None]
    # A mode that does not measure attention: None for the whole entry.
    full = create_cacheblend_rag_chain(
        inner, ChatCacheBlend(engine=tiny_engine, max_new_tokens=5, mode="full_recompute"), return_source_documents=True
    ).invoke(QUESTION)
    assert full["chunk_attention"] is None and full["answer"]
