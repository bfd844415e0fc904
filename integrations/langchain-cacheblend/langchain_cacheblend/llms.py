"""``CacheBlendLLM``: a LangChain text-completion model backed by a ``CacheBlendEngine``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun, Callbacks
from langchain_core.language_models import BaseLLM, LanguageModelInput
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.prompt_values import PromptValue

from cacheblend_rag.serving import Run
from cacheblend_rag.serving.aio import iterate_in_thread

from ._base import CALL_PARAMS, CacheBlendParams
from .inputs import RAGPromptValue

# BaseLLM keys its cache on the model's identifying params and the stop list, not on the call's
# keyword arguments (BaseChatModel's key has them), so invoke(x, seed=2) or .bind(mode=...) would
# be served an answer cached under other settings. generate()/agenerate() put the call's settings
# where the key is read; a context variable keeps concurrent calls (threads, tasks) apart.
_call_settings: ContextVar[Mapping[str, Any]] = ContextVar("cacheblend_call_settings", default=MappingProxyType({}))


def _settings_of(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {("max_new_tokens" if k == "max_tokens" else k): v for k, v in kwargs.items() if k in CALL_PARAMS}


class CacheBlendLLM(CacheBlendParams, BaseLLM):
    """Drop-in LLM for RAG chains that reuses each retrieved chunk's cached KV.

    Chunks reach it in two ways:

    * explicitly: ``llm.invoke({"question": q, "context": [Document, ...]})`` or a
      :class:`~langchain_cacheblend.RAGPromptValue` (its documents are the chunks, whatever
      ``match_chunks`` says);
    * implicitly: any prompt string in which chunk texts the registry knows (registered by
      :class:`~langchain_cacheblend.CacheBlendRetriever` or ``precompute_vectorstore``) appear
      verbatim. The engine is then asked ``generate(question=<prompt minus chunks>, chunks=<found
      chunks, in order>)``.

    A prompt without any known chunk is answered as a plain chat message with a full prefill
    (``response_metadata["mode"] == "plain_chat"``), or raises if ``require_chunks=True``.
    The answer's ``generation_info`` carries the engine's stats (ttft_s, chunk_hits, ...).

    Example:
        .. code-block:: python

            llm = CacheBlendLLM()                       # loads the bundled model on first use
            retriever = CacheBlendRetriever(retriever=vectorstore.as_retriever(), llm=llm)
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    """

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, *, engine_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> CacheBlendLLM:
        """Load the engine now (``CacheBlendEngine.from_pretrained``) rather than on first use."""
        from cacheblend_rag import CacheBlendEngine

        return cls(engine=CacheBlendEngine.from_pretrained(model, **(engine_kwargs or {})), **kwargs)

    @property
    def _llm_type(self) -> str:
        return "cacheblend"

    @property
    def _identifying_params(self) -> Mapping[str, Any]:
        return {**self._params(), **_call_settings.get()}

    def generate(
        self, prompts: list[str], stop: list[str] | None = None, callbacks: Callbacks | list[Callbacks] = None, **kwargs: Any
    ) -> LLMResult:
        token = _call_settings.set(_settings_of(kwargs))
        try:
            return super().generate(prompts, stop, callbacks, **kwargs)
        finally:
            _call_settings.reset(token)

    async def agenerate(
        self, prompts: list[str], stop: list[str] | None = None, callbacks: Callbacks | list[Callbacks] = None, **kwargs: Any
    ) -> LLMResult:
        token = _call_settings.set(_settings_of(kwargs))
        try:
            return await super().agenerate(prompts, stop, callbacks, **kwargs)
        finally:
            _call_settings.reset(token)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        return self._ls_fields(stop, kwargs, "llm")

    def _convert_input(self, model_input: LanguageModelInput) -> PromptValue:
        if isinstance(model_input, Mapping):
            model_input = RAGPromptValue.from_input(model_input)
        if isinstance(model_input, RAGPromptValue):
            # Its text brings its chunks (ChunkedText); registered too, as retrieved chunks are, so
            # a prompt made from that text later still finds them.
            self.chunk_registry.add(model_input.chunks)
        return super()._convert_input(model_input)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        for run in self._runs(prompts, stop, kwargs):
            for delta in run:
                if run_manager is not None:
                    run_manager.on_llm_new_token(delta)
            generations.append([self._generation(run)])
        return LLMResult(generations=generations, llm_output={"model_name": self._model_label})

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # Not BaseLLM's default (_generate in an executor thread, which cancelling ainvoke cannot
        # stop: it would decode to max_new_tokens holding the engine). Each step runs in a worker
        # thread; a cancelled call closes its run.
        generations = []
        for run in self._runs(prompts, stop, kwargs):
            async for delta in iterate_in_thread(iter(run)):
                if run_manager is not None:
                    await run_manager.on_llm_new_token(delta)
            generations.append([self._generation(run)])
        return LLMResult(generations=generations, llm_output={"model_name": self._model_label})

    def _runs(self, prompts: Sequence[str], stop: list[str] | None, kwargs: dict[str, Any]) -> Iterable[Run]:
        # With a batcher every run is submitted before any is read, so they are decoded together.
        # Without one each run starts when the previous has finished: a run's clock starts when it
        # is created, and its time to first token must not include the runs before it.
        if self.batcher is not None:
            return [self._start(self._request_from_text(p), stop, kwargs) for p in prompts]
        return (self._start(self._request_from_text(p), stop, kwargs) for p in prompts)

    def _generation(self, run: Run) -> Generation:
        assert run.result is not None
        return Generation(text=run.result.text, generation_info=self._metadata(run))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        run = self._start(self._request_from_text(prompt), stop, kwargs)
        for delta in run:
            chunk = GenerationChunk(text=delta)
            if run_manager is not None:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._metadata(run))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        run = self._start(self._request_from_text(prompt), stop, kwargs)  # errors raise here
        async for delta in iterate_in_thread(iter(run)):
            chunk = GenerationChunk(text=delta)
            if run_manager is not None:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._metadata(run))
