"""The prompt layout's answer hint: where it goes, when it is on, and that it never touches chunk caches."""

from __future__ import annotations

import pytest

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.chat.prompt import DEFAULT_INSTRUCTION, SHORT_ANSWER_HINT, PromptBuilder
from cacheblend_rag.store import KVStore
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_model


def _question_text(builder: PromptBuilder, question: str) -> str:
    seg = builder.build(question, ["a passage"]).segments[-1]
    return builder.tokenizer.decode(list(seg.token_ids))


def test_no_hint_by_default_and_a_given_hint_follows_the_question_inside_the_user_turn(tokenizer):
    plain = PromptBuilder(tokenizer)
    assert plain.answer_hint == "" and _question_text(plain, "Who wrote it?") == "Question: Who wrote it?" + plain.tail_text
    p = PromptBuilder(tokenizer, answer_hint=SHORT_ANSWER_HINT)
    text = _question_text(p, "  Who wrote it? ")
    assert text == f"Question: Who wrote it?\n{SHORT_ANSWER_HINT}" + p.tail_text
    assert p.question_text("Who wrote it?") == text


@pytest.mark.parametrize(
    "instruction, hint, expected",
    [
        ("Summarise the documents in two sentences.", "Use two sentences.", "Use two sentences."),
        (DEFAULT_INSTRUCTION, "", ""),
        (DEFAULT_INSTRUCTION, "  Reply in French.\n", "Reply in French."),
    ],
)
def test_a_hint_is_stripped_and_placed_after_the_question(tokenizer, instruction, hint, expected):
    p = PromptBuilder(tokenizer, instruction, answer_hint=hint)
    assert p.answer_hint == expected
    body = "Question: Why?" + (f"\n{expected}" if expected else "")
    assert _question_text(p, "Why?") == body + p.tail_text


def test_a_hint_that_is_not_text_is_refused(tokenizer):
    with pytest.raises(TypeError, match="answer_hint must be a str"):
        PromptBuilder(tokenizer, answer_hint=1)


def test_engines_with_other_hints_share_chunk_caches(tokenizer, tmp_path):
    # The hint lives in the question segment, which is always recomputed: chunk caches are keyed
    # by the instruction prefix alone, so changing the hint must not invalidate them.
    model = make_model("llama")
    store = KVStore(tmp_path / "kv")
    first = CacheBlendEngine(model, tokenizer, store=store, pipelined=False)
    first.precompute(SAMPLE_CHUNKS, progress=False)
    other = CacheBlendEngine(model, tokenizer, store=store, pipelined=False, answer_hint="Answer in one word.")
    result = other.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=2)
    assert result.stats["chunk_hits"] == len(SAMPLE_CHUNKS) and result.stats["chunk_misses"] == 0
    assert (
        other.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS).segments[-1]
        != first.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS).segments[-1]
    )
    first.close()


def test_token_cache_keeps_the_most_recently_used_texts_within_its_bytes():
    from cacheblend_rag.chat.prompt import TokenCache

    ids = tuple(range(10))
    size = TokenCache.entry_bytes("text-00", ids)
    cache = TokenCache(max_bytes=64 * size)  # 64 entries (the largest entry it keeps is 1/64 of it)
    for i in range(64):
        cache.put(f"text-{i:02d}", ids)
    assert cache.get("text-00") == ids  # now the most recently used
    cache.put("text-64", ids)  # evicts text-01, the least recently used
    assert cache.get("text-01") is None and cache.get("text-00") == cache.get("text-64") == ids
    assert len(cache) == 64 and cache.bytes == 64 * size == cache.max_bytes
    cache.put("long " * 2000, ids)  # larger than max_bytes // 64: never kept
    assert cache.get("long " * 2000) is None and len(cache) == 64
