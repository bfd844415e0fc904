"""``CacheBlendRetriever`` and ``precompute_vectorstore``: make retrieved chunks known (and cached)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import InMemoryVectorStore
from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from tqdm.auto import tqdm

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.chat.matching import ChunkRegistry
from cacheblend_rag.engine.capacity import check_room
from cacheblend_rag.neighbours.learned import LearnConfig
from cacheblend_rag.threads import helper_pool

from ._base import CacheBlendParams

log = logging.getLogger(__name__)


def _resolve(llm_or_engine: Any) -> tuple[CacheBlendEngine, ChunkRegistry]:
    if isinstance(llm_or_engine, CacheBlendParams):
        return llm_or_engine.get_engine(), llm_or_engine.chunk_registry
    if isinstance(llm_or_engine, CacheBlendEngine):
        return llm_or_engine, ChunkRegistry.for_engine(llm_or_engine)
    raise TypeError(f"expected a CacheBlendLLM, ChatCacheBlend or CacheBlendEngine, got {type(llm_or_engine).__name__}")


class CacheBlendRetriever(BaseRetriever):
    """Wraps any retriever; returns its documents unchanged and makes their texts known to the model.

    Every retrieved ``page_content`` is registered in the model's chunk registry, so the model
    finds those chunks again inside a formatted prompt. ``precompute`` also computes their KV:

    * ``False`` (default): nothing more; a chunk's KV is computed the first time a prompt uses it
      (a cache miss) and reused from then on;
    * ``"sync"``: compute missing chunk KV before returning the documents (the following model
      call then only has cache hits);
    * ``"background"``: compute it in a worker thread; useful when retrieval happens well before
      generation. ``wait()`` blocks until it is done. The worker runs single-threaded, so it
      never slows the model's own thread (``cacheblend_rag.threads``).

    ``neighbours`` (default 2; 0 turns it off): with ``precompute``, each retrieved chunk is also
    cached behind its ``neighbours`` most similar chunks of the same retrieval, which answers much
    closer to a full prefill. ``learn=True`` also has the engine learn which chunks are retrieved
    together and cache each chunk behind its most frequent predecessors in the background
    (``CacheBlendEngine.learn_neighbours``; a repeated question may then be answered differently
    once, closer to full prefill). Cost: one extra chunk prefill (behind ``neighbours`` chunks) per
    neighbour-aware cache, and its storage (up to 4 per chunk besides its plain cache).

    Give ``llm`` (a CacheBlendLLM/ChatCacheBlend) or ``engine``; ``registry`` overrides theirs.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    llm: CacheBlendParams | None = None
    engine: CacheBlendEngine | None = None
    registry: ChunkRegistry | None = None
    precompute: Literal["sync", "background", False] = False
    neighbours: int = Field(default=2, ge=0)
    learn: bool = False

    _pool: ThreadPoolExecutor | None = PrivateAttr(default=None)
    _pending: list[Future] = PrivateAttr(default_factory=list)
    _pending_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)  # batch() registers from threads

    @model_validator(mode="after")
    def _needs_a_model(self) -> CacheBlendRetriever:
        if self.llm is None and self.engine is None and (self.registry is None or self.precompute):
            raise ValueError(
                "CacheBlendRetriever needs llm= (a CacheBlendLLM or ChatCacheBlend) or engine= "
                "(or registry= alone when precompute=False)"
            )
        return self

    def _target(self) -> tuple[CacheBlendEngine | None, ChunkRegistry]:
        if self.llm is not None:
            engine, registry = _resolve(self.llm)
        elif self.engine is not None:
            engine, registry = _resolve(self.engine)
        else:
            engine, registry = None, self.registry
        return engine, self.registry if self.registry is not None else registry

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        docs = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        self._register(docs)
        return docs

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        docs = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        if self.precompute == "sync":
            await asyncio.to_thread(self._register, docs)
        else:
            self._register(docs)
        return docs

    def _register(self, docs: list[Document]) -> None:
        texts = [d.page_content for d in docs if d.page_content.strip()]
        engine, registry = self._target()
        registry.add(texts)
        if engine is not None and self.learn and self.neighbours:
            engine.learn_neighbours(LearnConfig(neighbours=self.neighbours))
        if not self.precompute or not texts:
            return
        assert engine is not None
        if self.precompute == "sync":
            _precompute(engine, texts, self.neighbours)
            return
        with self._pending_lock:
            if self._pool is None:
                self._pool = helper_pool("cacheblend-precompute")
            # Drop finished jobs, but keep the failed ones for wait() to re-raise.
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
            self._pending.append(self._pool.submit(_precompute_logged, engine, texts, self.neighbours))

    def wait(self) -> None:
        """Block until background precomputation has finished, every job of it; then re-raise
        the first error. A failed job must not leave later ones running unwatched: a caller that
        closes the engine after ``wait()`` would close it under them."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        errors = [fut.exception() for fut in pending]  # waits for each job
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


def _precompute(engine: CacheBlendEngine, texts: list[str], neighbours: int = 0, check_room: bool = True) -> int:
    with engine.lock:
        return engine.precompute(texts, neighbours=neighbours, progress=False, check_room=check_room)


def _precompute_logged(engine: CacheBlendEngine, texts: list[str], neighbours: int = 0) -> int:
    try:
        return _precompute(engine, texts, neighbours)
    except Exception:
        log.exception("background KV precompute failed")
        raise


def _texts_of(source: Any) -> Iterable[str]:
    if isinstance(source, InMemoryVectorStore):
        return (v["text"] for v in list(source.store.values()))
    if isinstance(source, (str, bytes)):
        raise TypeError("pass a vector store or a list of Documents/strings, not a single string")
    if hasattr(source, "similarity_search") and not hasattr(source, "__iter__"):
        raise TypeError(
            f"cannot list the documents of a {type(source).__name__}: pass the Documents you "
            "added to it (an iterable of Documents or strings) instead"
        )
    return ((d.page_content if isinstance(d, Document) else _as_text(d)) for d in source)


def _as_text(item: Any) -> str:
    if not isinstance(item, str):
        raise TypeError(f"expected Documents or strings, got {type(item).__name__}")
    return item


def precompute_vectorstore(
    vectorstore_or_documents: Any,
    llm_or_engine: Any,
    *,
    batch_size: int = 32,
    progress: bool = True,
    neighbours: int = 2,
    learn: bool = False,
) -> int:
    """Compute and store the KV of every document, and register their texts with the model.

    ``vectorstore_or_documents``: an ``InMemoryVectorStore`` (its stored documents are read) or
    any iterable of Documents or strings. ``llm_or_engine``: a CacheBlendLLM, ChatCacheBlend or
    CacheBlendEngine. Already cached chunks are skipped. Returns how many chunks were computed.
    ``neighbours`` (default 2; 0: plain caches only) also caches each document prefilled behind
    its ``neighbours`` most similar documents of the whole collection (``CacheBlendEngine.precompute``:
    about ``neighbours + 1`` times the plain precompute, and twice the storage); precompute again
    after the collection changes. ``learn=True`` also has the engine learn better neighbours from
    the chunks retrieved together (``CacheBlendEngine.learn_neighbours``). A store that cannot
    hold the whole collection's caches (its size limit, or its disk's free space) raises
    ``cacheblend_rag.engine.capacity.StoreTooSmall`` before anything is computed.
    """
    if isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 0:
        raise ValueError(f"neighbours={neighbours!r} must be an int >= 0 (0: plain chunk caches only)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    engine, registry = _resolve(llm_or_engine)
    # The whole collection is planned before the first batch: a store that cannot hold it is
    # refused (capacity.StoreTooSmall) before anything is computed, not after it evicted its first
    # chunks; and neighbours are chosen across the whole collection, not within a batch.
    everything = list(dict.fromkeys(t for t in _texts_of(vectorstore_or_documents) if t.strip()))
    if not everything:
        return 0
    with engine.lock:
        plan = engine.plan_precompute(everything, neighbours=neighbours)
    check_room(plan, engine.store)
    if learn and neighbours:
        engine.learn_neighbours(LearnConfig(neighbours=neighbours))
    if neighbours:
        registry.add(everything)
        computed = _precompute(engine, everything, neighbours, check_room=False)
        engine.flush()
        return computed
    computed = 0
    with tqdm(total=len(everything), desc="precompute KV", unit="chunk", disable=not progress) as bar:
        for start in range(0, len(everything), batch_size):
            batch = everything[start : start + batch_size]
            registry.add(batch)
            computed += _precompute(engine, batch, check_room=False)
            bar.update(len(batch))
    engine.flush()
    return computed
