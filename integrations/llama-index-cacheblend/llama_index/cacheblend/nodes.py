"""How LlamaIndex nodes become CacheBlend chunks.

A chunk's KV is stored under its exact text, so the text a query hands the engine must be the text
precompute stored. Everything that turns a node into a chunk goes through :func:`node_text` with one
``metadata_mode`` for that reason.

Default: ``MetadataMode.LLM``, the text LlamaIndex's own synthesizers put in the prompt (node text
plus the metadata not listed in ``excluded_llm_metadata_keys``). Use ``MetadataMode.NONE`` to feed
the bare text, e.g. when metadata changes often and should not invalidate cached chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.chat.matching import ChunkRegistry

log = logging.getLogger(__name__)

DEFAULT_METADATA_MODE = MetadataMode.LLM

NodeLike = BaseNode | NodeWithScore


def node_text(node: NodeLike, metadata_mode: MetadataMode = DEFAULT_METADATA_MODE) -> str:
    """The chunk text the engine caches and prefills for ``node``."""
    base = node.node if isinstance(node, NodeWithScore) else node
    return base.get_content(metadata_mode=metadata_mode)


def has_text(node: NodeLike) -> bool:
    # Judge emptiness on the bare text: metadata alone is no passage to answer from.
    return bool(node_text(node, MetadataMode.NONE).strip())


def node_chunks(
    engine: CacheBlendEngine,
    nodes: Sequence[NodeLike],
    metadata_mode: MetadataMode = DEFAULT_METADATA_MODE,
    *,
    what: str = "retrieved nodes",
    allow_none: bool = False,
) -> list[str]:
    """Chunk texts of ``nodes`` in order, checked against the engine and registered in its
    ``ChunkRegistry`` (so ``CacheBlendLLM`` also finds them inside plain, templated prompts).

    Nodes without text are skipped (a retriever can return them; they carry nothing to answer
    from). Raises ValueError when no node has text (unless ``allow_none``) or when one node alone
    does not fit the model's context window, naming the node so the user can re-split it.
    """
    chunks: list[str] = []
    skipped = 0
    plen = len(engine.prompts.prefix_ids)
    for node in nodes:
        if not has_text(node):
            skipped += 1
            continue
        text = node_text(node, metadata_mode)
        n = len(engine.prompts.chunk_segment(text))
        if plen + n > engine.context_window:
            base = node.node if isinstance(node, NodeWithScore) else node
            raise ValueError(
                f"node {base.node_id} is {n} tokens ({plen + n} with the instruction prefix), more "
                f"than the model's context window of {engine.context_window} tokens: split the "
                "documents into smaller nodes, e.g. SentenceSplitter(chunk_size=...)"
            )
        chunks.append(text)
    ChunkRegistry.for_engine(engine).add(chunks)
    if skipped:
        log.warning("skipped %d of %d %s without text", skipped, len(nodes), what)
    if not chunks and not allow_none:
        if not nodes:
            raise ValueError(
                f"no {what}: the index is empty or nothing matched; CacheBlend answers over "
                "retrieved passages, so add documents to the index first"
            )
        raise ValueError(
            f"all {len(nodes)} {what} are empty (no text): the index holds nothing to answer "
            "from; check that the documents you loaded contain text"
        )
    return chunks
