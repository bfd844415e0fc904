"""Both framework integrations check a call the same way, through the one request path: an unknown
per-call setting is refused with the same ``TypeError`` (``serving.request.call_settings``), and
chunks without a question with the same ``ValueError`` (``Request.over_chunks``), before any
model work."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_cacheblend")
pytest.importorskip("llama_index.cacheblend")

from cacheblend_rag.chat.matching import ChunkRegistry
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine
from langchain_cacheblend import CacheBlendLLM as LangChainLLM
from langchain_cacheblend import ChatCacheBlend, rag_message
from llama_index.cacheblend import CacheBlendLLM as LlamaIndexLLM


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = make_engine("llama", seed=0, store_dir=tmp_path_factory.mktemp("kv"), pipelined=False)
    yield eng
    eng.close()


def _error(call) -> tuple[type[BaseException], str]:
    with pytest.raises((TypeError, ValueError)) as caught:
        call()
    return type(caught.value), str(caught.value)


def _calls(engine) -> dict[str, dict[str, object]]:
    """Per front end: a call with an unknown setting, and one with chunks but a blank question."""
    lc = LangChainLLM(engine=engine, registry=ChunkRegistry())
    chat = ChatCacheBlend(engine=engine, registry=ChunkRegistry())
    li = LlamaIndexLLM(engine=engine, match_chunks=False)
    return {
        "langchain llm": {
            "unknown": lambda: lc.invoke({"question": SAMPLE_QUESTION, "context": SAMPLE_CHUNKS}, bogus=1),
            "blank": lambda: lc.invoke({"question": "  ", "context": SAMPLE_CHUNKS}),
        },
        "langchain chat": {
            "unknown": lambda: chat.invoke([rag_message(SAMPLE_QUESTION, SAMPLE_CHUNKS)], bogus=1),
            "blank": lambda: chat.invoke([rag_message(" ", SAMPLE_CHUNKS)]),
        },
        "llama_index": {
            "unknown": lambda: li.complete(SAMPLE_QUESTION, bogus=1),
            "blank": lambda: li.answer_chunks("  ", SAMPLE_CHUNKS),
        },
        "llama_index chunks": {
            "unknown": lambda: li.answer_chunks(SAMPLE_QUESTION, SAMPLE_CHUNKS, bogus=1),
            "blank": lambda: li.stream_chunks("\n", SAMPLE_CHUNKS),
        },
    }


def test_both_integrations_refuse_an_unknown_setting_alike(engine):
    errors = {front: _error(calls["unknown"]) for front, calls in _calls(engine).items()}
    for front, (kind, message) in errors.items():
        assert kind is TypeError, front
        # The accepted names are each framework's own (LangChain takes OpenAI's max_tokens, and
        # its stop strings apart); the refusal is the same.
        assert message.startswith("unknown generation arguments ['bogus']; accepted: mode, recompute_ratio, max_new_tokens"), (
            front,
            message,
        )


def test_both_integrations_refuse_chunks_without_a_question_alike(engine):
    errors = {front: _error(calls["blank"]) for front, calls in _calls(engine).items()}
    assert len(set(errors.values())) == 1, errors
    kind, message = next(iter(errors.values()))
    assert kind is ValueError and "no question" in message


def test_neither_integration_reads_the_others_private_attributes():
    """The LlamaIndex tool path asks the LLM through its public methods (it once read
    ``llm._match`` and ``llm._settings``)."""
    import ast
    import inspect

    from llama_index.cacheblend import tools

    tree = ast.parse(inspect.getsource(tools))
    private = sorted(
        {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in ("llm", "engine")
        }
    )
    assert private == []
