"""``ChatCacheBlend``: a LangChain chat model backed by a ``CacheBlendEngine``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompt_values import PromptValue

from cacheblend_rag.serving import Request, Run
from cacheblend_rag.serving.aio import iterate_in_thread

from ._base import CacheBlendParams
from .inputs import RAGPromptValue
from .tools import ToolCallingMixin, chunk_fields, message_fields


class ChatCacheBlend(ToolCallingMixin, CacheBlendParams, BaseChatModel):
    """Chat model for RAG that reuses each retrieved chunk's cached KV.

    Chunks come from, in this order of precedence:

    1. content blocks flagged as chunks (``chunk_block(doc)`` / ``rag_message(question, docs)``,
       or a dict ``{"question": ..., "context": [...]}`` passed to ``invoke``); every unflagged
       text becomes the question turn;
    2. otherwise, known chunk texts (registered by ``CacheBlendRetriever`` or
       ``precompute_vectorstore``) found verbatim inside the messages' text.

    The engine builds its own prompt (its instruction, "Documents:" + chunks, "Question: ...").
    The text of the messages outside the chunks, in order and joined by blank lines (assistant
    turns prefixed "Assistant: "), becomes that question. Messages without any chunk are answered
    as a plain chat through the model's chat template with a full prefill, unless
    ``require_chunks=True``. ``response_metadata`` carries the engine's stats; non-text content is
    not supported.

    ``bind_tools`` and ``with_structured_output`` work through the model's chat template and
    constrained decoding (:mod:`langchain_cacheblend.tools`); the chunks still reach the engine as
    chunks.
    """

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, *, engine_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> ChatCacheBlend:
        """Load the engine now (``CacheBlendEngine.from_pretrained``) rather than on first use."""
        from cacheblend_rag import CacheBlendEngine

        return cls(engine=CacheBlendEngine.from_pretrained(model, **(engine_kwargs or {})), **kwargs)

    @property
    def _llm_type(self) -> str:
        return "cacheblend-chat"

    @property
    def _identifying_params(self) -> Mapping[str, Any]:
        return self._params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        return self._ls_fields(stop, kwargs, "chat")

    def _convert_input(self, model_input: LanguageModelInput) -> PromptValue:
        if isinstance(model_input, Mapping):
            model_input = RAGPromptValue.from_input(model_input)
        return super()._convert_input(model_input)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        run = self._start(self._request_from_messages(messages), stop, kwargs)
        for delta in run:
            if run_manager is not None:
                run_manager.on_llm_new_token(delta)
        return self._result(run)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # Not BaseChatModel's default (_generate in an executor thread, which cancelling ainvoke
        # cannot stop: it would decode to max_new_tokens holding the engine). Each step runs in a
        # worker thread; a cancelled call closes its run.
        run = self._start(self._request_from_messages(messages), stop, kwargs)
        async for delta in iterate_in_thread(iter(run)):
            if run_manager is not None:
                await run_manager.on_llm_new_token(delta)
        return self._result(run)

    def _start(self, request: Request, stop: Sequence[str] | None, overrides: dict[str, Any]) -> Run:
        # invoke(..., stream=True/False) is BaseChatModel's own switch between _stream and
        # _generate, passed on to them once it has been acted on: not a generation setting.
        return super()._start(request, stop, {k: v for k, v in overrides.items() if k != "stream"})

    def _result(self, run: Run) -> ChatResult:
        assert run.result is not None
        meta = self._metadata(run)
        message = AIMessage(content=run.result.text, response_metadata=meta, usage_metadata=_usage(meta), **message_fields(run))
        return ChatResult(generations=[ChatGeneration(message=message)], llm_output={"model_name": self._model_label})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # BaseChatModel reports each yielded chunk to the callbacks itself.
        run = self._start(self._request_from_messages(messages), stop, kwargs)
        for delta in run:
            yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
        yield self._last_chunk(run)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        run = self._start(self._request_from_messages(messages), stop, kwargs)
        async for delta in iterate_in_thread(iter(run)):
            yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
        yield self._last_chunk(run)

    def _last_chunk(self, run: Run) -> ChatGenerationChunk:
        meta = self._metadata(run)
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content="", response_metadata=meta, usage_metadata=_usage(meta), chunk_position="last", **chunk_fields(run)
            )
        )


def _usage(meta: dict[str, Any]) -> UsageMetadata:
    """Token counts; ``input_token_details["cache_read"]`` is the chunk tokens whose KV was read
    from the chunk cache instead of prefilled (the reused part of ``input_tokens``)."""
    n_in, n_out = int(meta.get("prompt_tokens", 0)), int(meta.get("generated_tokens", 0))
    return UsageMetadata(
        input_tokens=n_in,
        output_tokens=n_out,
        total_tokens=n_in + n_out,
        input_token_details=InputTokenDetails(cache_read=int(meta.get("cache_read_tokens", 0))),
    )
