"""CacheBlendQueryEngine: retriever -> (postprocessors) -> CacheBlendSynthesizer."""

from __future__ import annotations

from typing import Any, Literal

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, QueryBundle

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.chat.prompt import validate_question
from cacheblend_rag.neighbours.learned import LearnConfig

from .llm import CacheBlendLLM
from .nodes import DEFAULT_METADATA_MODE
from .precompute import precompute_index
from .synthesizer import CacheBlendSynthesizer


def _resolve_llm(llm: CacheBlendLLM | None, engine: CacheBlendEngine | None, gen: dict[str, Any]) -> CacheBlendLLM:
    """``llm`` as given, else a CacheBlendLLM over ``engine`` (default: the bundled model)."""
    if llm is not None:
        if not isinstance(llm, CacheBlendLLM):
            raise TypeError(
                f"llm must be a CacheBlendLLM, got {type(llm).__name__}: wrap your engine as CacheBlendLLM(engine=...)"
            )
        if engine is not None or gen:
            raise TypeError("pass either llm= or engine=/generation settings, not both")
        return llm
    return CacheBlendLLM(engine=engine if engine is not None else CacheBlendEngine.from_pretrained(), **gen)


class CacheBlendQueryEngine(RetrieverQueryEngine):
    """A ``RetrieverQueryEngine`` whose synthesizer is always a :class:`CacheBlendSynthesizer`.

    ``query("")`` raises ValueError before anything is retrieved.
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        response_synthesizer: CacheBlendSynthesizer,
        node_postprocessors: list[BaseNodePostprocessor] | None = None,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        if not isinstance(response_synthesizer, CacheBlendSynthesizer):
            raise TypeError(
                "CacheBlendQueryEngine needs a CacheBlendSynthesizer (other synthesizers repack "
                f"the nodes and lose the chunk caches), got {type(response_synthesizer).__name__}"
            )
        super().__init__(retriever, response_synthesizer, node_postprocessors, callback_manager)

    @classmethod
    def from_index(
        cls,
        index: Any,
        engine: CacheBlendEngine | None = None,
        similarity_top_k: int = 6,
        precompute: bool = True,
        streaming: bool = False,
        *,
        metadata_mode: MetadataMode = DEFAULT_METADATA_MODE,
        node_postprocessors: list[BaseNodePostprocessor] | None = None,
        show_progress: bool = True,
        llm: CacheBlendLLM | None = None,
        text_qa_template: BasePromptTemplate | None = None,
        neighbours: int = 2,
        learn: bool = False,
        source_scores: Literal["retriever", "attention"] = "retriever",
        **gen: Any,
    ) -> CacheBlendQueryEngine:
        """Query ``index`` with CacheBlend in one line.

        llm: the CacheBlendLLM to answer with (e.g. the one in ``Settings.llm``); else one is
            built over ``engine`` (default: the bundled model) with the ``**gen`` settings.
        text_qa_template: the prompt around the chunks (see :class:`CacheBlendSynthesizer`).
        source_scores: ``response.source_nodes`` scored by the retriever (default) or by the
            question's attention share (``"attention"``; the retriever's score then stays in
            ``node.metadata["retriever_score"]``; see :class:`CacheBlendSynthesizer`).
        similarity_top_k: nodes retrieved per query, each one a cached chunk.
        precompute: store the KV of every node in the index now (``precompute_index``), so even
            the first query reuses caches. Without it a chunk is computed (and stored) the first
            time it is retrieved.
        neighbours: neighbour-aware caches (``precompute_index``; default 2, 0 turns them off):
            each node also cached behind its most similar nodes; answers get closer to a full
            prefill's.
        learn: also cache nodes behind the nodes they are retrieved with, as the engine learns
            them (``CacheBlendEngine.learn_neighbours``); a repeated query's answer may then change
            once, towards full prefill's.
        **gen: CacheBlendLLM fields: mode ("cacheblend"), recompute_ratio (engine default 0.15),
            max_new_tokens (128), temperature (0.0), top_p, top_k, seed.
        """
        llm = _resolve_llm(llm, engine, gen)
        if precompute:
            precompute_index(
                index, llm.engine, progress=show_progress, metadata_mode=metadata_mode, neighbours=neighbours, learn=learn
            )
        elif learn and neighbours:
            llm.engine.learn_neighbours(LearnConfig(neighbours=neighbours))
        synth = CacheBlendSynthesizer(
            llm=llm,
            streaming=streaming,
            metadata_mode=metadata_mode,
            text_qa_template=text_qa_template,
            source_scores=source_scores,
        )
        return cls(
            retriever=index.as_retriever(similarity_top_k=similarity_top_k),
            response_synthesizer=synth,
            node_postprocessors=node_postprocessors,
        )

    @classmethod
    def from_args(  # type: ignore[override]
        cls,
        retriever: BaseRetriever,
        llm: CacheBlendLLM | None = None,
        node_postprocessors: list[BaseNodePostprocessor] | None = None,
        callback_manager: CallbackManager | None = None,
        streaming: bool = False,
        metadata_mode: MetadataMode = DEFAULT_METADATA_MODE,
        text_qa_template: BasePromptTemplate | None = None,
        engine: CacheBlendEngine | None = None,
        source_scores: Literal["retriever", "attention"] = "retriever",
        **gen: Any,
    ) -> CacheBlendQueryEngine:
        """Like ``RetrieverQueryEngine.from_args`` but always with a CacheBlendSynthesizer
        (``llm``, else one over ``engine``, default the bundled model)."""
        llm = _resolve_llm(llm, engine, gen)
        synth = CacheBlendSynthesizer(
            llm=llm,
            streaming=streaming,
            metadata_mode=metadata_mode,
            text_qa_template=text_qa_template,
            source_scores=source_scores,
        )
        return cls(retriever, synth, node_postprocessors, callback_manager)

    @property
    def synthesizer(self) -> CacheBlendSynthesizer:
        return self._response_synthesizer  # type: ignore[return-value]

    @property
    def llm(self) -> CacheBlendLLM:
        return self.synthesizer.llm

    @property
    def engine(self) -> CacheBlendEngine:
        return self.llm.engine

    def with_retriever(self, retriever: BaseRetriever) -> CacheBlendQueryEngine:
        return type(self)(retriever, self.synthesizer, self._node_postprocessors, self.callback_manager)

    # Check the question before the retriever embeds it, so an empty one fails clearly and cheaply.
    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        validate_question(query_bundle.query_str)
        return super()._query(query_bundle)

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        validate_question(query_bundle.query_str)
        return await super()._aquery(query_bundle)
