"""Fill the engine's KV store ahead of queries: a whole index, or each query's retrieved nodes."""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.neighbours.learned import LearnConfig

from .llm import CacheBlendLLM
from .nodes import DEFAULT_METADATA_MODE, node_chunks

EngineLike = CacheBlendEngine | CacheBlendLLM


def as_engine(obj: EngineLike) -> CacheBlendEngine:
    if isinstance(obj, CacheBlendLLM):
        return obj.engine
    if isinstance(obj, CacheBlendEngine):
        return obj
    raise TypeError(f"expected a CacheBlendEngine or CacheBlendLLM, got {type(obj).__name__}")


def index_nodes(index: Any) -> list[BaseNode]:
    """The nodes an index retrieves from (for a VectorStoreIndex: its docstore entries)."""
    docstore = getattr(index, "docstore", None)
    if docstore is None:
        raise TypeError(f"{type(index).__name__} has no docstore: pass a LlamaIndex index such as VectorStoreIndex")
    struct = getattr(index, "index_struct", None)
    ids = list(getattr(struct, "nodes_dict", {}).values()) if struct is not None else []
    if ids:
        return docstore.get_nodes(ids, raise_error=False)
    # Other index kinds keep their nodes straight in the docstore.
    return list(docstore.docs.values())


def precompute_index(
    index: Any,
    engine: EngineLike,
    progress: bool = True,
    *,
    metadata_mode: MetadataMode = DEFAULT_METADATA_MODE,
    neighbours: int = 2,
    learn: bool = False,
) -> int:
    """Store the chunk KV of every node of ``index`` (a tqdm bar when ``progress``).

    ``neighbours`` (default 2; 0: plain caches only) also caches each node prefilled behind its
    ``neighbours`` most similar nodes of the index (``CacheBlendEngine.precompute``): answers much
    closer to a full prefill, for about ``neighbours + 1`` times the precompute and twice the
    storage. Run it again after the index changes. ``learn=True`` also has the engine learn better
    neighbours from the nodes retrieved together (``CacheBlendEngine.learn_neighbours``).

    Idempotent: nodes already cached are skipped. Returns how many chunks were computed. Nodes
    without text are skipped; an index with no text at all, or a node longer than the model's
    context window, raises ValueError. A store that cannot hold the whole index's caches (its size
    limit, or its disk's free space) raises ``cacheblend_rag.engine.capacity.StoreTooSmall``
    before anything is computed (``CacheBlendEngine.precompute``'s check). A vector store that keeps the nodes itself (no docstore
    entries) raises too: precompute its node texts with ``engine.precompute`` instead.
    """
    eng = as_engine(engine)
    nodes = index_nodes(index)
    if not nodes:
        raise ValueError(
            "the index has no nodes in its docstore: add documents first (or, for a vector store "
            "that keeps the text itself, call engine.precompute([node_text(n) for n in nodes]))"
        )
    chunks = node_chunks(eng, nodes, metadata_mode, what="nodes in the index")
    computed = eng.precompute(chunks, neighbours=neighbours, progress=progress)
    if learn and neighbours:
        eng.learn_neighbours(LearnConfig(neighbours=neighbours))
    return computed


class CacheBlendPrecompute(BaseNodePostprocessor):
    """Node postprocessor that stores the KV of the retrieved nodes and passes them on unchanged.

    Put it last in ``node_postprocessors`` when you do not precompute the whole index: the chunk
    caches then exist before synthesis (also for a synthesizer other than CacheBlend's, e.g. when
    answers are produced later or elsewhere from the same store).
    """

    metadata_mode: MetadataMode = Field(default=DEFAULT_METADATA_MODE, description="as in the synthesizer")
    show_progress: bool = Field(default=False, description="tqdm bar while computing")
    _engine: CacheBlendEngine = PrivateAttr()

    def __init__(self, engine: EngineLike, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = as_engine(engine)

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendPrecompute"

    @property
    def engine(self) -> CacheBlendEngine:
        return self._engine

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        # Empty retrievals pass through: the synthesizer reports them with a clear error.
        chunks = node_chunks(self._engine, nodes, self.metadata_mode, allow_none=True)
        if chunks:
            self._engine.precompute(chunks, progress=self.show_progress)
        return nodes
