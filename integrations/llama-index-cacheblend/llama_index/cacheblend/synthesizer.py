"""CacheBlendSynthesizer: retrieved nodes -> one CacheBlend prefill, one chunk per node.

LlamaIndex's default ``compact`` mode repacks node texts into as few prompts as fit, which moves
chunk boundaries and makes every cached chunk KV useless. Here each node stays its own chunk,
in retrieved order, with the question as the suffix.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Dict, Generator, List, Optional, Sequence

import llama_index.core.instrumentation as instrument
from cacheblend_rag.prompt import validate_question
from llama_index.core.base.response.schema import RESPONSE_TYPE, Response, StreamingResponse
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from ._aio import iterate_in_thread
from .llm import CacheBlendLLM, drain_and_flush
from .nodes import DEFAULT_METADATA_MODE, node_chunks

try:  # llama-index-core >= 0.12.x ships an async streaming response
    from llama_index.core.base.response.schema import AsyncStreamingResponse
except ImportError:  # pragma: no cover - older cores
    AsyncStreamingResponse = None  # type: ignore[assignment,misc]

dispatcher = instrument.get_dispatcher(__name__)

#: ``Response.metadata`` key holding the engine's stats (chunk_hits, chunk_misses, ttft_s, ...).
STATS_KEY = "cacheblend"


class CacheBlendSynthesizer(BaseSynthesizer):
    """Answer over retrieved nodes with CacheBlend.

    Args:
        llm: the :class:`CacheBlendLLM` (engine + generation settings). Built from ``engine`` and
            ``**gen`` (its fields: mode, recompute_ratio, max_new_tokens, temperature, ...) when
            omitted.
        streaming: return a ``StreamingResponse`` whose ``response_gen`` yields text deltas.
        metadata_mode: how a node becomes chunk text (default ``MetadataMode.LLM``); precompute
            with the same mode or the caches will not be found.

    The response's ``metadata`` maps node ids to node metadata as usual, plus ``"cacheblend"``:
    the engine's stats (for a streaming response, filled in once the stream is exhausted).
    Empty or missing nodes raise ValueError instead of LlamaIndex's "Empty Response".
    """

    def __init__(
        self,
        llm: Optional[CacheBlendLLM] = None,
        *,
        engine: Any = None,
        streaming: bool = False,
        metadata_mode: MetadataMode = DEFAULT_METADATA_MODE,
        callback_manager: Optional[CallbackManager] = None,
        **gen: Any,
    ) -> None:
        if llm is None:
            llm = CacheBlendLLM(engine=engine, **gen)
        elif not isinstance(llm, CacheBlendLLM):
            raise TypeError(
                f"CacheBlendSynthesizer needs a CacheBlendLLM, got {type(llm).__name__}: wrap your "
                "engine as CacheBlendLLM(engine=...)"
            )
        elif engine is not None or gen:
            raise TypeError("pass either llm or engine/generation settings, not both")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._metadata_mode = metadata_mode

    @property
    def llm(self) -> CacheBlendLLM:
        return self._llm  # type: ignore[return-value]

    @property
    def metadata_mode(self) -> MetadataMode:
        return self._metadata_mode

    def _get_prompts(self) -> PromptDictType:
        # The prompt is the engine's chat template around the chunks; no LlamaIndex templates.
        return {}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if prompts:
            raise ValueError("CacheBlendSynthesizer has no prompt templates to update")

    # ------------------------------------------------------------------ text-level API
    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        """Answer over already-extracted chunk texts (each one a separate cached chunk)."""
        stream = self.llm.stream_chunks(query_str, text_chunks, **response_kwargs)
        gen = drain_and_flush(self.llm.engine, stream)
        return gen if self._streaming else "".join(gen)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        stream = self.llm.stream_chunks(query_str, text_chunks, **response_kwargs)
        agen = iterate_in_thread(drain_and_flush(self.llm.engine, stream))
        if self._streaming:
            return agen
        return "".join([d async for d in agen])

    # ------------------------------------------------------------------ node-level API
    def _prepare(
        self,
        query: QueryTextType,
        nodes: List[NodeWithScore],
        additional_source_nodes: Optional[Sequence[NodeWithScore]],
    ) -> tuple[str, list[str], list[NodeWithScore], Dict[str, Any]]:
        """The question, the chunks, the source nodes and the response metadata of one request."""
        query_str = query.query_str if isinstance(query, QueryBundle) else query
        validate_question(query_str)
        chunks = node_chunks(self.llm.engine, nodes, self._metadata_mode)
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        metadata = dict(self._get_metadata_for_response([n.node for n in source_nodes]) or {})
        return query_str, chunks, source_nodes, metadata

    @dispatcher.span
    def synthesize(
        self,
        query: QueryTextType,
        nodes: List[NodeWithScore],
        additional_source_nodes: Optional[Sequence[NodeWithScore]] = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        query_str, chunks, source_nodes, metadata = self._prepare(query, nodes, additional_source_nodes)
        with self._callback_manager.event(CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query_str}) as event:
            stream = self.llm.stream_chunks(query_str, chunks, **response_kwargs)
            deltas = drain_and_flush(self.llm.engine, stream)
            response: RESPONSE_TYPE
            if self._streaming:
                response = StreamingResponse(
                    _with_stats(deltas, stream, metadata), source_nodes=source_nodes, metadata=metadata
                )
            else:
                text = "".join(deltas)
                metadata[STATS_KEY] = stream.result.stats  # type: ignore[union-attr]
                response = Response(text, source_nodes=source_nodes, metadata=metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    @dispatcher.span
    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: List[NodeWithScore],
        additional_source_nodes: Optional[Sequence[NodeWithScore]] = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        query_str, chunks, source_nodes, metadata = self._prepare(query, nodes, additional_source_nodes)
        with self._callback_manager.event(CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query_str}) as event:
            stream = self.llm.stream_chunks(query_str, chunks, **response_kwargs)
            deltas = iterate_in_thread(drain_and_flush(self.llm.engine, stream))
            response: RESPONSE_TYPE
            if self._streaming and AsyncStreamingResponse is not None:
                response = AsyncStreamingResponse(
                    _awith_stats(deltas, stream, metadata), source_nodes=source_nodes, metadata=metadata
                )
            elif self._streaming:  # pragma: no cover - older cores: a sync stream
                response = StreamingResponse(
                    _with_stats(drain_and_flush(self.llm.engine, stream), stream, metadata),
                    source_nodes=source_nodes,
                    metadata=metadata,
                )
            else:
                text = "".join([d async for d in deltas])
                metadata[STATS_KEY] = stream.result.stats  # type: ignore[union-attr]
                response = Response(text, source_nodes=source_nodes, metadata=metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response


def _with_stats(deltas, stream, metadata: Dict[str, Any]) -> Generator[str, None, None]:
    yield from deltas
    metadata[STATS_KEY] = stream.result.stats


async def _awith_stats(deltas, stream, metadata: Dict[str, Any]) -> AsyncGenerator[str, None]:
    async for d in deltas:
        yield d
    metadata[STATS_KEY] = stream.result.stats
