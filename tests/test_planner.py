"""The planner on hand-made layouts and store contents: no model, no store object."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig
from cacheblend_rag.blend.planner import (
    COMPUTE,
    MASKED_KEY_COST,
    PREFIX,
    STORE,
    causal_plan,
    context_attention,
    guide,
    plan_fusion,
    plan_prefix,
    suffix_blocks_pay,
)
from cacheblend_rag.chat.prompt import PromptLayout, Segment
from cacheblend_rag.model.attention import row_groups
from cacheblend_rag.neighbours.index import NeighbourCache, NeighbourIndex
from cacheblend_rag.store.keys import chunk_key

FP = "planner-test-model"
PREFIX_IDS = (1, 2, 3)
CHUNKS = ((10, 11, 12, 13), (20, 21, 22), (30, 31, 32, 33, 34))
QUESTION = (40, 41)


def _layout(chunks=CHUNKS, prefix=PREFIX_IDS) -> PromptLayout:
    return PromptLayout(
        (Segment("prefix", prefix, reusable=False),)
        + tuple(Segment(f"chunk {i}", c, reusable=True) for i, c in enumerate(chunks))
        + (Segment("question", QUESTION, reusable=False),)
    )


def _plain_key(chunk) -> str:
    return chunk_key(FP, PREFIX_IDS, chunk)


def _prefix_key() -> str:
    return chunk_key(FP, (), PREFIX_IDS)


def _fusion(layout, stored, mode="cacheblend", config=None, **kw):
    return plan_fusion(
        layout,
        mode,
        config or BlendConfig(strategy="hkvd"),
        fingerprint=FP,
        prefix_ids=PREFIX_IDS,
        contains=stored.__contains__,
        num_layers=4,
        **kw,
    )


# ------------------------------------------------------------------ prefix caching


def _prefix_keys(layout) -> list[str]:
    ids = layout.token_ids
    return [chunk_key(FP, ids[:off], seg.token_ids) for seg, off in zip(layout.segments[:-1], layout.offsets())]


def test_prefix_plan_loads_every_cached_segment_and_prefills_the_question():
    layout = _layout()
    req = plan_prefix(layout, FP, set(_prefix_keys(layout)).__contains__)
    assert [(s.start, s.length, s.delta) for s in req.loads] == [(0, 3, 0), (3, 4, 0), (7, 3, 0), (10, 5, 0)]
    assert req.reused == layout.offsets()[-1] and req.writebacks == []
    assert (req.hits, req.misses) == (3, 0)


def test_prefix_plan_stops_at_the_first_miss_and_writes_back_the_rest():
    layout = _layout()
    keys = _prefix_keys(layout)
    stored = {keys[0], keys[1], keys[3]}  # chunk 1 missing: chunk 2 is cached but no longer a prefix
    req = plan_prefix(layout, FP, stored.__contains__)
    assert [s.key for s in req.loads] == keys[:2] and req.reused == 7
    assert req.writebacks == [(keys[2], 7, 3), (keys[3], 10, 5)]
    assert (req.hits, req.misses) == (1, 2)
    assert req.plan.always.nonzero().flatten().tolist() == list(range(7, len(layout)))


@pytest.mark.parametrize(
    "reused,length,blocks",
    [(553, 3072, False), (7, 17, False), (90, 105, True), (3000, 3050, True), (1, 3000, False), (0, 50, False)],
)
def test_a_suffix_uses_masked_blocks_only_where_they_read_far_fewer_keys(reused, length, blocks):
    assert suffix_blocks_pay(reused, length) is blocks
    if blocks:  # never more key reads than a causal prefill of the whole prompt, even at MASKED_KEY_COST
        reads = sum((b - a) * keys for a, b, keys in row_groups(torch.arange(reused, length), 1))
        assert MASKED_KEY_COST * reads <= length * (length + 1) // 2
    segments = (
        Segment("prefix", tuple(range(reused)), reusable=False),
        Segment("question", (5,) * (length - reused), reusable=False),
    )
    layout = PromptLayout(segments)
    assert causal_plan(layout, reused).causal_suffix is not blocks


def test_prefix_plan_never_loads_a_key_lost_earlier():
    layout = _layout()
    keys = _prefix_keys(layout)
    req = plan_prefix(layout, FP, set(keys).__contains__, avoid={keys[0]})
    assert req.loads == [] and req.reused == 0 and len(req.writebacks) == 4


# ------------------------------------------------------------------ fused modes


def test_fusion_plan_marks_exact_candidate_and_always_positions():
    layout = _layout()
    stored = {_prefix_key(), *map(_plain_key, CHUNKS)}
    req = _fusion(layout, stored)
    plan = req.plan
    assert plan.input_ids.tolist() == layout.token_ids
    # The prefix comes from the process's own copy even when the store holds it: a quantized
    # record of it would not be exact.
    assert [(load.spec.start, load.spec.length, load.spec.delta, load.source) for load in req.loads] == [
        (0, 3, 0, PREFIX),
        (3, 4, 0, STORE),
        (7, 3, 4, STORE),
        (10, 5, 7, STORE),
    ]
    # The first chunk sits behind exactly the prefix it was cached behind: reused as is.
    assert plan.candidate.nonzero().flatten().tolist() == list(range(7, 15))
    assert plan.always.nonzero().flatten().tolist() == [15, 16]  # the question
    assert not plan.forced.any() and plan.num_query == 2
    assert (req.hits, req.misses, req.neighbour_hits) == (3, 0, 0)


def test_fusion_plan_computes_misses_and_never_loads_the_prefix_from_the_store():
    layout = _layout()
    stored = {_plain_key(CHUNKS[0])}
    req = _fusion(layout, stored, avoid={_plain_key(CHUNKS[0])})  # lost during an earlier attempt
    assert [load.source for load in req.loads] == [PREFIX, COMPUTE, COMPUTE, COMPUTE]
    assert (req.hits, req.misses) == (0, 3)
    req = _fusion(layout, stored)
    assert [load.source for load in req.loads] == [PREFIX, STORE, COMPUTE, COMPUTE]


def _index(entries):
    """NeighbourIndex from {chunk text: [(cache key, [texts behind], learned), ...]}."""
    index = NeighbourIndex()
    for text, caches in entries.items():
        for key, behind, learned in caches:
            index.add(_plain_key(text), NeighbourCache(key, tuple(map(_plain_key, behind)), learned))
    return index


def test_fusion_plan_reads_neighbour_aware_caches_except_for_the_first_chunk():
    layout = _layout()
    nb = _index({c: [(f"nb-{i}", [CHUNKS[(i + 1) % 3]], False)] for i, c in enumerate(CHUNKS)})
    stored = {_prefix_key(), *map(_plain_key, CHUNKS), "nb-0", "nb-1"}  # chunk 2's is gone
    req = _fusion(layout, stored, neighbours=nb)
    assert [load.spec.key for load in req.loads[1:]] == [_plain_key(CHUNKS[0]), "nb-1", _plain_key(CHUNKS[2])]
    assert req.neighbour_hits == 1 and req.hits == 3
    assert req.chunk_keys == tuple(map(_plain_key, CHUNKS))
    off = _fusion(layout, stored, config=BlendConfig(strategy="hkvd", neighbour_caches=False), neighbours=nb)
    assert off.neighbour_hits == 0 and [load.spec.key for load in off.loads[1:]] == list(map(_plain_key, CHUNKS))


def test_fusion_plan_picks_the_cache_whose_prefix_matches_the_chunks_in_front():
    layout = _layout()  # chunks 0, 1, 2 in this order
    other = (50, 51, 52)  # a chunk of the corpus that is not in this prompt
    nb = _index(
        {
            CHUNKS[2]: [
                ("similar", [other], False),  # embedding neighbours: none in the prompt
                ("learned-1", [other, CHUNKS[1]], True),  # one of them right in front
                ("learned-01", [CHUNKS[0], CHUNKS[1]], True),  # exactly the chunks in front, in order
                ("learned-10", [CHUNKS[1], CHUNKS[0]], True),  # the same chunks, other order
            ]
        }
    )
    stored = {_prefix_key(), *map(_plain_key, CHUNKS), "similar", "learned-1", "learned-01", "learned-10"}
    assert _fusion(layout, stored, neighbours=nb).loads[3].spec.key == "learned-01"
    # Gone from the store: the next best match, then any neighbour-aware cache over the plain one.
    assert _fusion(layout, stored - {"learned-01"}, neighbours=nb).loads[3].spec.key == "learned-10"
    # "learned-1" was learned behind a chunk this prompt does not hold (another request's text):
    # never served here (issue 52), however well its last chunk matches.
    assert _fusion(layout, stored - {"learned-01", "learned-10"}, neighbours=nb).loads[3].spec.key == "similar"
    assert _fusion(layout, {_prefix_key(), *map(_plain_key, CHUNKS), "similar"}, neighbours=nb).loads[3].spec.key == "similar"


def test_a_chunk_whose_text_changed_is_never_served_an_old_neighbour_cache():
    layout = _layout()
    old_text = CHUNKS[1] + (23,)  # chunk 1 before an edit
    nb = _index({old_text: [("old-text-cache", [CHUNKS[0]], True)]})
    stored = {_prefix_key(), *map(_plain_key, CHUNKS), "old-text-cache"}
    req = _fusion(layout, stored, neighbours=nb)
    assert "old-text-cache" not in [load.spec.key for load in req.loads] and req.neighbour_hits == 0


def test_hkvd_plans_checks_and_boundary_tokens():
    layout = _layout()
    config = BlendConfig(strategy="hkvd", recompute_ratio=0.5, filter_layers=2, boundary_tokens=1)
    plan = _fusion(layout, set(), config=config).plan
    assert plan.recompute_first_layer
    assert plan.forced.nonzero().flatten().tolist() == [7, 10]  # first token of each non-exact chunk
    # 12 context tokens, 2 forced: keep ceil(frac * 12) - 2 after each check layer.
    assert plan.checks == {1: 7, 2: 4}
    reuse = _fusion(layout, set(), mode="full_reuse", config=config).plan
    assert not reuse.recompute_first_layer and reuse.checks == {}


def test_checks_past_the_last_layer_are_dropped():
    config = BlendConfig(strategy="hkvd", schedule=((1, 0.5), (6, 0.2)))
    assert list(_fusion(_layout(), set(), config=config).plan.checks) == [1]


def test_a_prompt_without_the_cached_prefix_recomputes_its_head():
    layout = _layout(prefix=(9, 9, 9))
    req = _fusion(layout, {_prefix_key()})
    assert req.plan.always[:3].all() and [load.spec.start for load in req.loads] == [3, 7, 10]
    assert req.plan.candidate[3:7].all()  # no chunk is exact behind another prefix


# ------------------------------------------------------------------ question guidance


@pytest.mark.parametrize("strategy", ["question", "chunk"])
def test_guide_forces_what_the_question_reads_most_within_the_budget(strategy):
    layout = _layout()
    plan = _fusion(layout, set(), mode="cacheblend", config=BlendConfig(strategy=strategy)).plan
    scores = torch.zeros(len(layout))
    scores[[8, 9, 12]] = torch.tensor([0.5, 0.4, 0.8])  # chunk 1 holds two hot tokens (0.9 in all), chunk 2 the hottest
    config = BlendConfig(strategy=strategy, recompute_ratio=0.25)  # 3 of 12 context tokens
    guided = guide(plan, layout, config, scores, num_layers=4)
    picked = guided.forced.nonzero().flatten().tolist()
    assert picked == ([8, 9, 12] if strategy == "question" else [7, 8, 9])  # tokens, or the chunk read most
    assert not guided.recompute_first_layer and guided.checks == {}
    assert torch.equal(guided.candidate, plan.candidate) and torch.equal(guided.always, plan.always)


def test_guide_keeps_each_chunks_first_tokens_within_the_budget():
    # EPIC's boundary tokens under question guidance: forced on every layer, and paid for out of
    # the same recompute budget, so the question's picks shrink by as many.
    layout = _layout()
    config = BlendConfig(strategy="question", recompute_ratio=0.25, boundary_tokens=1)  # 3 of 12 context tokens
    plan = _fusion(layout, set(), mode="cacheblend", config=config).plan
    scores = torch.zeros(len(layout))
    scores[[8, 9, 12]] = torch.tensor([0.5, 0.4, 0.8])
    picked = guide(plan, layout, config, scores, num_layers=4).forced.nonzero().flatten().tolist()
    assert picked == [7, 10, 12]  # the non-exact chunks' first tokens, then the hottest token


@pytest.mark.parametrize("num_layers", [4, 1])
def test_hybrid_seeds_the_check_with_the_most_read_tokens(num_layers):
    layout = _layout()
    plan = _fusion(layout, set(), mode="cacheblend", config=BlendConfig(strategy="hybrid")).plan
    scores = torch.zeros(len(layout))
    scores[[4, 8, 9, 10, 12, 13, 14]] = torch.tensor([0.9, 0.5, 0.4, 0.1, 0.8, 0.3, 0.2])  # 4: the exact first chunk
    config = BlendConfig(strategy="hybrid", recompute_ratio=0.25)  # 3 of 12 context tokens, a seed of 6
    guided = guide(plan, layout, config, scores, num_layers=num_layers)
    if num_layers == 1:  # no layer to check on: the question's own top 3
        assert guided.forced.nonzero().flatten().tolist() == [8, 9, 12] and guided.checks == {}
        return
    assert guided.candidate.nonzero().flatten().tolist() == [8, 9, 10, 12, 13, 14]
    assert guided.recompute_first_layer and guided.checks == {1: 3} and not guided.forced.any()


def test_context_attention_spans_the_chunks_only_when_reweighting():
    layout = _layout()
    assert context_attention(layout, BlendConfig()) is None
    spec = context_attention(layout, BlendConfig(context_temperature=0.9, context_scale=0.9))
    assert (spec.start, spec.end) == (3, 15)
