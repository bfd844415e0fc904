"""CacheBlendSynthesizer: retrieved nodes -> one CacheBlend prefill, one chunk per node.

LlamaIndex's default ``compact`` mode repacks node texts into as few prompts as fit, which moves
chunk boundaries and makes every cached chunk KV useless. Here each node stays its own chunk,
in retrieved order. The answer goes through the LLM's ``complete``/``stream_complete`` (so LLM
callbacks, instrumentation events and ``TokenCountingHandler`` see it) with the QA template
formatted over the chunks, and the chunks passed alongside so none of them is repacked.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import Any, Literal

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import CompletionResponseAsyncGen, CompletionResponseGen
from llama_index.core.base.response.schema import RESPONSE_TYPE, Response, StreamingResponse
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.prompts.prompt_type import PromptType
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from cacheblend_rag.blend.sources import STATS_KEY as SOURCES_KEY
from cacheblend_rag.blend.sources import attention_by_text
from cacheblend_rag.chat.prompt import validate_question

from .llm import CacheBlendLLM
from .nodes import DEFAULT_METADATA_MODE, has_text, node_chunks, node_text

try:  # llama-index-core >= 0.12.x ships an async streaming response
    from llama_index.core.base.response.schema import AsyncStreamingResponse
except ImportError:  # pragma: no cover - older cores
    AsyncStreamingResponse = None  # type: ignore[assignment,misc]

dispatcher = instrument.get_dispatcher(__name__)

#: ``Response.metadata`` key holding the engine's stats (chunk_hits, chunk_misses, ttft_s, ...).
STATS_KEY = "cacheblend"

#: Node metadata key holding the retriever's score once ``source_nodes`` carry the attention share.
RETRIEVER_SCORE_KEY = "retriever_score"
SOURCE_SCORES = ("retriever", "attention")

#: The default QA template: the chunks, then the question. The engine's prompt adds its own
#: instruction, so the question turn is just the query.
DEFAULT_CACHEBLEND_QA_PROMPT = PromptTemplate("{context_str}\n\n{query_str}", prompt_type=PromptType.QUESTION_ANSWER)
CONTEXT_JOINER = "\n\n"


def check_qa_template(template: BasePromptTemplate) -> BasePromptTemplate:
    if not isinstance(template, BasePromptTemplate):
        raise TypeError(f"text_qa_template must be a LlamaIndex prompt template, got {type(template).__name__}")
    # A template may name its variables freely and map the standard names onto them.
    mappings = template.template_var_mappings or {}
    missing = {name for name in ("context_str", "query_str") if mappings.get(name, name) not in template.template_vars}
    if missing:
        raise ValueError(
            f"text_qa_template lacks {', '.join('{' + m + '}' for m in sorted(missing))}: it must hold "
            "{context_str} (where the chunks go) and {query_str} (the question)"
        )
    return template


class CacheBlendSynthesizer(BaseSynthesizer):
    """Answer over retrieved nodes with CacheBlend.

    Args:
        llm: the :class:`CacheBlendLLM` (engine + generation settings). Built from ``engine`` and
            ``**gen`` (its fields: mode, recompute_ratio, max_new_tokens, temperature, ...) when
            omitted.
        streaming: return a ``StreamingResponse`` whose ``response_gen`` yields text deltas.
        metadata_mode: how a node becomes chunk text (default ``MetadataMode.LLM``); precompute
            with the same mode or the caches will not be found.
        text_qa_template: the prompt around the chunks, with ``{context_str}`` (the chunks, joined
            by blank lines, unchanged) and ``{query_str}``; default ``"{context_str}\\n\\n{query_str}"``.
            The chunks become the engine's documents and the template's other text the question
            turn (after the engine's own instruction). Also settable with
            ``update_prompts({"text_qa_template": ...})``.
        source_scores: what ``response.source_nodes[i].score`` holds. ``"retriever"`` (default):
            the retriever's score; the nodes are returned as retrieved. ``"attention"``: the
            node's share of the question's attention (``cacheblend_rag.blend.sources``; the retrieved
            nodes' shares sum to 1, None for a node without text or repeating an earlier node's
            text), the way a reranker replaces the retriever's score. Each such node is a copy
            whose ``metadata["retriever_score"]`` keeps the retriever's score, left out of the
            text the LLM and the embedder see; nodes stay in retrieved order. Only where the
            answer's mode measures it (question-guided selection, the default); otherwise the
            nodes are returned as retrieved. On the models measured the share follows the
            chunk's place in the prompt more than its relevance (docs/sources.md): it says what
            the model read, not which node is relevant.

    The response's ``metadata`` maps node ids to node metadata as usual, plus ``"cacheblend"``:
    the engine's stats, ``chunk_attention`` among them (for a streaming response, filled in once
    the stream is exhausted, and the source nodes' scores with them).
    Empty or missing nodes raise ValueError instead of LlamaIndex's "Empty Response".
    """

    def __init__(
        self,
        llm: CacheBlendLLM | None = None,
        *,
        engine: Any = None,
        streaming: bool = False,
        metadata_mode: MetadataMode = DEFAULT_METADATA_MODE,
        callback_manager: CallbackManager | None = None,
        text_qa_template: BasePromptTemplate | None = None,
        source_scores: Literal["retriever", "attention"] = "retriever",
        **gen: Any,
    ) -> None:
        if source_scores not in SOURCE_SCORES:
            raise ValueError(
                f"source_scores={source_scores!r}: choose 'retriever' or 'attention' (the question's attention share)"
            )
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
        self._text_qa_template = check_qa_template(text_qa_template or DEFAULT_CACHEBLEND_QA_PROMPT)
        self._source_scores = source_scores

    @property
    def llm(self) -> CacheBlendLLM:
        return self._llm  # type: ignore[return-value]

    @property
    def metadata_mode(self) -> MetadataMode:
        return self._metadata_mode

    @property
    def source_scores(self) -> str:
        return self._source_scores

    def scored_sources(self, nodes: Sequence[NodeWithScore], stats: dict[str, Any]) -> list[NodeWithScore]:
        """``nodes`` (the retrieved ones, in order) with the question's attention share as their
        score (see ``source_scores``), or unchanged when the stats hold none."""
        shares = stats.get(SOURCES_KEY)
        if self._source_scores != "attention" or shares is None:
            return list(nodes)
        texts = [node_text(n, self._metadata_mode) if has_text(n) else "" for n in nodes]
        return [_rescored(n, share) for n, share in zip(nodes, attention_by_text(texts, shares))]

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        unknown = set(prompts) - {"text_qa_template"}
        if unknown:
            raise ValueError(f"unknown prompts {sorted(unknown)}: CacheBlendSynthesizer has only 'text_qa_template'")
        if "text_qa_template" in prompts:
            self._text_qa_template = check_qa_template(prompts["text_qa_template"])

    def format_prompt(self, query_str: str, chunks: Sequence[str]) -> str:
        """The QA template over ``chunks`` and ``query_str`` (what the LLM events show), inside the
        LLM's ``system_prompt`` and ``query_wrapper_prompt`` as ``LLM.predict`` would put it; the
        chunks stay unchanged, so that text becomes part of the question turn."""
        prompt = self._text_qa_template.format(context_str=CONTEXT_JOINER.join(chunks), query_str=query_str)
        return self.llm._extend_prompt(prompt)

    # ------------------------------------------------------------------ text-level API
    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        """Answer over already-extracted chunk texts (each one a separate cached chunk)."""
        chunks = list(text_chunks)
        prompt = self.format_prompt(query_str, chunks)
        if self._streaming:
            return _deltas(self.llm.stream_complete(prompt, formatted=True, chunks=chunks, **response_kwargs), {})
        return self.llm.complete(prompt, formatted=True, chunks=chunks, **response_kwargs).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        chunks = list(text_chunks)
        prompt = self.format_prompt(query_str, chunks)
        if self._streaming:
            return _adeltas(await self.llm.astream_complete(prompt, formatted=True, chunks=chunks, **response_kwargs), {})
        return (await self.llm.acomplete(prompt, formatted=True, chunks=chunks, **response_kwargs)).text

    # ------------------------------------------------------------------ node-level API
    def _prepare(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None,
    ) -> tuple[str, list[str], list[NodeWithScore], dict[str, Any]]:
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
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        query_str, chunks, source_nodes, metadata = self._prepare(query, nodes, additional_source_nodes)
        with self._callback_manager.event(CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query_str}) as event:
            prompt = self.format_prompt(query_str, chunks)
            response: RESPONSE_TYPE
            if self._streaming:
                responses = self.llm.stream_complete(prompt, formatted=True, chunks=chunks, **response_kwargs)
                response = StreamingResponse(
                    _deltas(responses, metadata, self._rescore(nodes, source_nodes)), source_nodes=source_nodes, metadata=metadata
                )
            else:
                completion = self.llm.complete(prompt, formatted=True, chunks=chunks, **response_kwargs)
                metadata[STATS_KEY] = completion.additional_kwargs["cacheblend"]
                response = Response(
                    completion.text, source_nodes=self._sources(nodes, source_nodes, metadata[STATS_KEY]), metadata=metadata
                )
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    @dispatcher.span
    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        query_str, chunks, source_nodes, metadata = self._prepare(query, nodes, additional_source_nodes)
        with self._callback_manager.event(CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query_str}) as event:
            prompt = self.format_prompt(query_str, chunks)
            response: RESPONSE_TYPE
            if self._streaming and AsyncStreamingResponse is not None:
                aresponses = await self.llm.astream_complete(prompt, formatted=True, chunks=chunks, **response_kwargs)
                response = AsyncStreamingResponse(
                    _adeltas(aresponses, metadata, self._rescore(nodes, source_nodes)),
                    source_nodes=source_nodes,
                    metadata=metadata,
                )
            elif self._streaming:  # pragma: no cover - older cores: a sync stream
                responses = self.llm.stream_complete(prompt, formatted=True, chunks=chunks, **response_kwargs)
                response = StreamingResponse(
                    _deltas(responses, metadata, self._rescore(nodes, source_nodes)), source_nodes=source_nodes, metadata=metadata
                )
            else:
                completion = await self.llm.acomplete(prompt, formatted=True, chunks=chunks, **response_kwargs)
                metadata[STATS_KEY] = completion.additional_kwargs["cacheblend"]
                response = Response(
                    completion.text, source_nodes=self._sources(nodes, source_nodes, metadata[STATS_KEY]), metadata=metadata
                )
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    def _sources(
        self, nodes: Sequence[NodeWithScore], source_nodes: list[NodeWithScore], stats: dict[str, Any]
    ) -> list[NodeWithScore]:
        # The retrieved nodes rescored; additional source nodes were no chunk: as given.
        return self.scored_sources(nodes, stats) + source_nodes[len(nodes) :]

    def _rescore(self, nodes: Sequence[NodeWithScore], source_nodes: list[NodeWithScore]) -> Callable[[dict[str, Any]], None]:
        """For a stream: rescore the response's own ``source_nodes`` list once the stats arrive."""
        retrieved = list(nodes)

        def on_stats(stats: dict[str, Any]) -> None:
            source_nodes[:] = self._sources(retrieved, source_nodes, stats)

        return on_stats


def _rescored(node: NodeWithScore, share: float | None) -> NodeWithScore:
    """A copy of ``node`` scored ``share``, the retriever's score kept in its metadata (excluded
    from the LLM's and the embedder's text, so the chunk text and its cache key stay the same).
    The node object itself may be the docstore's: it is never changed."""
    base = node.node.model_copy()
    base.metadata = {**node.node.metadata, RETRIEVER_SCORE_KEY: node.score}
    base.excluded_llm_metadata_keys = [*node.node.excluded_llm_metadata_keys, RETRIEVER_SCORE_KEY]
    base.excluded_embed_metadata_keys = [*node.node.excluded_embed_metadata_keys, RETRIEVER_SCORE_KEY]
    return NodeWithScore(node=base, score=share)


def _deltas(
    responses: CompletionResponseGen, metadata: dict[str, Any], on_stats: Callable[[dict[str, Any]], None] | None = None
) -> Generator[str, None, None]:
    """The text deltas of a completion stream; its last response's stats go into ``metadata``
    and to ``on_stats``."""
    for r in responses:
        if "cacheblend" in r.additional_kwargs:
            metadata[STATS_KEY] = r.additional_kwargs["cacheblend"]
            if on_stats is not None:
                on_stats(metadata[STATS_KEY])
        if r.delta:
            yield r.delta


async def _adeltas(
    responses: CompletionResponseAsyncGen, metadata: dict[str, Any], on_stats: Callable[[dict[str, Any]], None] | None = None
) -> AsyncGenerator[str, None]:
    async for r in responses:
        if "cacheblend" in r.additional_kwargs:
            metadata[STATS_KEY] = r.additional_kwargs["cacheblend"]
            if on_stats is not None:
                on_stats(metadata[STATS_KEY])
        if r.delta:
            yield r.delta
