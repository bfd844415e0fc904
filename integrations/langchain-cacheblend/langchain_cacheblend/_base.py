"""Fields and request building shared by :class:`CacheBlendLLM` and :class:`ChatCacheBlend`."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.chat.matching import ChunkRegistry
from cacheblend_rag.chat.messages import split_messages
from cacheblend_rag.serving import Batcher, Request, Run
from cacheblend_rag.serving.request import call_settings

from .inputs import ChunkedText

NO_CHUNKS = (
    "no chunks found in the prompt: wrap your retriever with CacheBlendRetriever (or precompute "
    "the documents with precompute_vectorstore) so the model knows the chunk texts, or pass the "
    "documents explicitly ({'question': ..., 'context': [Document, ...]})"
)
NO_MATCH = (
    "the prompt contains none of the {n} registered chunk texts, so it is answered with a full "
    "prefill and no KV reuse. Chunks are found verbatim (after strip): a format_docs that adds "
    "titles or numbering inside a document, truncates or rewrites it hides the chunks. Join the "
    "unchanged page_content (e.g. '\\n\\n'.join(d.page_content for d in docs)), or pass the "
    "documents explicitly (create_cacheblend_rag_chain, rag_message, or {{'question': ..., "
    "'context': [Document, ...]}}). This warning is shown once per model; every answer's "
    "metadata reports chunks_matched."
)
# Generation settings a call may override with invoke(..., **kwargs) or .bind(...).
CALL_PARAMS = ("mode", "recompute_ratio", "max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed")
_load_lock = threading.Lock()


class CacheBlendParams(BaseModel):
    """Settings of the CacheBlend models (documented defaults)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, protected_namespaces=())

    engine: CacheBlendEngine | None = None
    """The engine to answer with. None: ``CacheBlendEngine.from_pretrained(model_name)`` on first use."""
    model_name: str | None = Field(default=None, alias="model")
    """Model to load when no ``engine`` is given (None: the bundled SmolLM2-135M-Instruct)."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``CacheBlendEngine.from_pretrained`` (device, dtype, store_dir...)."""
    registry: ChunkRegistry | None = None
    """Known chunk texts for finding chunks in plain prompts. None: the engine's shared registry."""
    mode: Literal["cacheblend", "full_recompute", "prefix_caching", "full_reuse"] = "cacheblend"
    """How the chunks' KV is prefilled; ``full_recompute`` is the plain full-prefill baseline."""
    recompute_ratio: float | None = None
    """Fraction of chunk tokens recomputed per layer (None: the engine config's, 0.15 by default)."""
    max_new_tokens: int = Field(default=128, alias="max_tokens")
    """Most tokens to generate (``max_tokens`` is accepted too)."""
    temperature: float = 0.0
    """0 is greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    """Sampling seed (only used when temperature > 0)."""
    stop: list[str] | None = None
    """Stop strings, added to any passed per call."""
    require_chunks: bool = False
    """Raise when a prompt holds no known chunk instead of answering it as a plain chat."""
    match_chunks: bool = True
    """Find registered chunk texts inside plain prompts (the implicit path). The engine then builds
    its own prompt: its instruction, the found chunks as "Documents:", and the prompt's remaining
    text (your template's instructions and the question) as the question turn. False: prompts
    without explicit chunks are answered exactly as written (your template, chat roles kept) with
    a full prefill and no reuse."""
    streaming: bool = False
    """Chat model: route ``invoke`` through streaming (LangChain's standard flag)."""
    max_batch: int = Field(default=1, ge=1)
    """Answers decoded together when calls overlap (``batch``, ``abatch``, concurrent ``ainvoke``,
    threads): above 1, requests go through a ``cacheblend_rag.serving.Batcher`` that decodes up
    to this many answers in one forward per token. 1: one answer at a time."""

    _loaded: CacheBlendEngine | None = PrivateAttr(default=None)
    _warned_no_match: bool = PrivateAttr(default=False)

    # ------------------------------------------------------------------ engine + registry
    def get_engine(self) -> CacheBlendEngine:
        """The engine, loading the default one on first use when none was given."""
        if self.engine is not None:
            return self.engine
        with _load_lock:
            if self._loaded is None:
                self._loaded = CacheBlendEngine.from_pretrained(self.model_name, **self.engine_kwargs)
        return self._loaded

    @property
    def chunk_registry(self) -> ChunkRegistry:
        return self.registry if self.registry is not None else ChunkRegistry.for_engine(self.get_engine())

    @property
    def _model_label(self) -> str:
        if self.engine is not None:
            return self.engine.model_id
        if self._loaded is not None:
            return self._loaded.model_id
        return self.model_name or "SmolLM2-135M-Instruct"

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (LangChain's default would fetch GPT-2)."""
        return list(self.get_engine().tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generation_fields(self) -> dict[str, Any]:
        """The fields every request starts from; per-call overrides go on top."""
        return {
            "mode": self.mode,
            "recompute_ratio": self.recompute_ratio,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
        }

    def _params(self) -> dict[str, Any]:
        # LangChain's LLM cache keys on these, so everything that can change the text is here:
        # the fields, and what the engine was loaded with (engine_kwargs such as answer_hint, a
        # calibrated ratio), which loads the default engine if it is not loaded yet.
        # LangChain sets "stop" itself to the call's stop list, hence the field's own name.
        fields = {"default_stop": self.stop, "match_chunks": self.match_chunks}
        engine = self.get_engine().answer_settings()
        return {"model": self._model_label, **self._generation_fields(), **fields, "engine": engine}

    def _ls_fields(self, stop: list[str] | None, kwargs: dict[str, Any], model_type: str) -> dict[str, Any]:
        params: dict[str, Any] = {
            "ls_provider": "cacheblend",
            "ls_model_name": kwargs.get("model") or self._model_label,
            "ls_model_type": model_type,
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens)),
        }
        stops = self._stops(stop)
        if stops:
            params["ls_stop"] = stops
        return params

    # ------------------------------------------------------------------ requests
    def _stops(self, stop: Sequence[str] | None) -> list[str]:
        return list(dict.fromkeys([*(self.stop or []), *(stop or [])]))

    def generation_settings(self, stop: Sequence[str] | None, overrides: dict[str, Any]) -> dict[str, Any]:
        """The fields, the call's overrides on top, and the stop strings: ``Request.with_settings``'s names."""
        return {**call_settings(self._generation_fields(), overrides, CALL_PARAMS), "stop": self._stops(stop)}

    def _request_from_text(self, prompt: str) -> Request:
        """Implicit chunks: known chunk texts found verbatim in the prompt.

        The engine is called as ``generate(question=<prompt minus the chunks>, chunks=<matches in
        order>)``: the template's surrounding text (instructions, labels, the user's question)
        becomes the engine's question turn, the chunks its "Documents:" list. A RAGPromptValue's
        text (:class:`ChunkedText`) brings its documents: they are the chunks, as for a chat model.
        """
        chunks = [c for c in prompt.chunks if c.strip()] if isinstance(prompt, ChunkedText) else []
        if chunks:
            return Request.over_chunks(prompt.question.strip(), chunks, "explicit", 0)
        if not self.match_chunks:
            return self._no_chunks([{"role": "user", "content": prompt}], prompt)
        registry = self.chunk_registry
        match = registry.match(prompt)
        if not match.spans:
            self._warn_no_match(registry)
            return self._no_chunks([{"role": "user", "content": prompt}], prompt)
        return Request.over_chunks(match.remainder(), match.chunks, "matched", len(match.spans))

    def _request_from_messages(self, messages: Sequence[BaseMessage]) -> Request:
        """Chunks from flagged content blocks if any message has them, else found in the text."""
        registry = self.chunk_registry if self.match_chunks else None
        split = split_messages([(_role(m), m.content) for m in messages], registry)
        if not split.chunks:
            if registry is not None:
                self._warn_no_match(registry)
            return self._no_chunks(list(split.messages), split.question)
        if split.explicit:
            return Request.over_chunks(split.question, split.chunks, "explicit", 0)
        return Request.over_chunks(split.question, split.chunks, "matched", len(split.chunks))

    def _warn_no_match(self, registry: ChunkRegistry) -> None:
        """Once per model: chunks are registered, yet this prompt contains none of them verbatim."""
        if self._warned_no_match or len(registry) == 0:
            return
        self._warned_no_match = True
        warnings.warn(NO_MATCH.format(n=len(registry)), UserWarning, stacklevel=2)

    def _no_chunks(self, messages: list[dict[str, str]], text: str) -> Request:
        if self.require_chunks:
            raise ValueError(NO_CHUNKS)
        # Honest fallback: answer the prompt as an ordinary chat with a full prefill.
        return Request.plain_chat(messages, text)

    def _start(self, request: Request, stop: Sequence[str] | None, overrides: dict[str, Any]) -> Run:
        return Run(self.get_engine(), request.with_settings(**self.generation_settings(stop, overrides)), batcher=self.batcher)

    @property
    def batcher(self) -> Batcher | None:
        """The batcher serving this model's requests (None when ``max_batch`` is 1), shared by
        every model on the same engine with the same ``max_batch``; its ``steps`` and
        ``rows_stepped`` tell how many answers shared each decode step."""
        return None if self.max_batch <= 1 else Batcher.for_engine(self.get_engine(), self.max_batch)

    def _metadata(self, run: Run) -> dict[str, Any]:
        assert run.result is not None
        return {
            "model_name": self._model_label,
            "finish_reason": run.result.finish_reason,
            "question": run.request.question,
            "chunk_source": run.request.chunk_source,
            "chunks_matched": run.request.chunks_matched,
            **run.result.stats,
        }


def _role(msg: BaseMessage) -> str:
    if isinstance(msg, SystemMessage):
        return "system"
    if isinstance(msg, AIMessage):
        return "assistant"
    if isinstance(msg, HumanMessage):
        return "user"
    raise ValueError(f"{type(msg).__name__} is not supported: CacheBlend chat models take system, human, AI and tool messages")
