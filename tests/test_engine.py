"""Engine behaviour on tiny random models, checked against full prefill as the reference."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig
from cacheblend_rag.blend.fusor import causal_mask
from cacheblend_rag.decode.generation import eos_token_ids
from cacheblend_rag.model.attention import row_groups
from cacheblend_rag.rope import shift_keys
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION

CHUNKS = SAMPLE_CHUNKS
Q = SAMPLE_QUESTION


def _kv(cache, layer):
    return cache.layers[layer].keys, cache.layers[layer].values


def test_ratio_one_equals_full_prefill(engine):
    layout = engine.build_layout(Q, CHUNKS)
    full = engine.prefill(layout, "full_recompute")
    blend = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=1.0, strategy="hkvd"))
    torch.testing.assert_close(blend.logits, full.logits, rtol=1e-4, atol=1e-5)
    for i in range(engine.num_layers):
        for a, b in zip(_kv(blend.cache, i), _kv(full.cache, i)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_prefix_caching_is_exact_and_reuses_on_second_call(engine):
    layout = engine.build_layout(Q, CHUNKS)
    full = engine.prefill(layout, "full_recompute")
    first = engine.prefill(layout, "prefix_caching")
    engine.flush()
    second = engine.prefill(layout, "prefix_caching")
    for res in (first, second):
        torch.testing.assert_close(res.logits, full.logits, rtol=1e-4, atol=1e-5)
    assert first.stats["chunk_hits"] == 0
    assert second.stats["chunk_hits"] == len(CHUNKS)
    # Only the question is computed once every earlier segment is cached under its exact prefix.
    assert second.stats["recomputed_per_layer"][0] == len(layout.segments[-1])


def test_full_reuse_is_the_rope_shifted_concatenation_of_chunk_caches(engine):
    layout = engine.build_layout(Q, CHUNKS)
    res = engine.prefill(layout, "full_reuse")
    plen = len(engine.prompts.prefix_ids)
    rotary = engine.model.model.rotary_emb
    for seg, off in zip(layout.segments, layout.offsets()):
        if not seg.reusable:
            continue
        alone = engine.compute_chunk(seg)
        for i in range(engine.num_layers):
            k, v = _kv(res.cache, i)
            torch.testing.assert_close(k[0, :, off : off + len(seg)], shift_keys(rotary, alone[i][0], off - plen))
            torch.testing.assert_close(v[0, :, off : off + len(seg)], alone[i][1])
    # The instruction prefix is exact (loaded from its own cache); only the question is computed.
    assert res.stats["recomputed_per_layer"] == [len(layout.segments[-1])] * engine.num_layers


def test_rope_shift_moves_a_key_to_its_new_position(engine):
    # On layer 0 a token's key depends only on the token and its position, so the chunk computed
    # behind a longer prefix must equal the chunk cached behind the standard one, shifted.
    seg = engine.prompts.chunk_segment(CHUNKS[1])
    cached = engine.compute_chunk(seg)[0][0]
    extra = engine.prompts.encode(CHUNKS[0] + "\n\n")
    ids = torch.tensor([list(engine.prompts.prefix_ids) + list(extra) + list(seg.token_ids)])
    with torch.inference_mode():
        out = engine.model(input_ids=ids, use_cache=True)
    k0 = out.cache.layers[0].keys[0, :, -len(seg) :]
    torch.testing.assert_close(shift_keys(engine.model.model.rotary_emb, cached, len(extra)), k0, rtol=1e-4, atol=1e-5)


def test_selected_sets_shrink_layer_by_layer(engine):
    layout = engine.build_layout(Q, CHUNKS)
    cfg = BlendConfig(recompute_ratio=0.2, filter_layers=2, strategy="hkvd")  # checks on layers 1 and 2 of 0..3
    res = engine.prefill(layout, "cacheblend", cfg)
    sizes = [int(s.numel()) for s in res.selected]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    for a, b in zip(res.selected, res.selected[1:]):
        assert set(b.tolist()) <= set(a.tolist())
    # After the schedule, the kept context tokens are the budget, plus the question.
    fixed = len(layout.segments[-1])
    budget = -(-int(0.2 * layout.num_context_tokens * 1e6) // 10**6)  # ceil
    assert sizes[-1] == fixed + min(budget, layout.num_context_tokens - len(layout.segments[1]))
    # The first chunk sits behind the instruction exactly as it was cached: never recomputed.
    exact = range(0, layout.offsets()[2])  # the instruction and the first chunk
    assert not set(exact) & set(res.selected[0].tolist())


def test_check_layer_refreshes_every_token_but_computes_only_the_kept(engine):
    # Layers 0 and 1 see exact inputs for every token (layer 0 is recomputed in full), so their
    # K/V must equal full prefill's everywhere, including tokens the check on layer 1 drops. The
    # dropped tokens skip layer 1's attention and MLP: computed < refreshed there.
    layout = engine.build_layout(Q, CHUNKS)
    full = engine.prefill(layout, "full_recompute")
    res = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.2, filter_layers=1, strategy="hkvd"))
    for i in (0, 1):
        for a, b in zip(_kv(res.cache, i), _kv(full.cache, i)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    later = max(float((a - b).abs().max()) for a, b in zip(_kv(res.cache, 2), _kv(full.cache, 2)))
    assert later > 1e-3  # control: with 20% recomputed, layer 2 is not exact
    computed, refreshed = res.stats["computed_per_layer"], res.stats["recomputed_per_layer"]
    assert computed[0] == refreshed[0] and computed[1] < refreshed[1]
    assert computed[1] == refreshed[2] and computed[2:-1] == refreshed[2:-1]
    assert res.stats["compute_fraction"] < res.stats["recompute_fraction"]


def test_last_layer_runs_attention_and_mlp_for_the_last_position_only(engine):
    # Only the last position's output reaches the logits; the other selected tokens need their
    # last-layer K/V alone. test_ratio_one_equals_full_prefill checks that those K/V and the logits
    # stay exact; this checks that the work is actually skipped.
    layout = engine.build_layout(Q, CHUNKS)
    last = engine.model.model.layers[-1]
    rows: dict[str, int] = {}
    hooks = [
        mod.register_forward_hook(lambda m, args, out, name=name: rows.__setitem__(name, args[0].shape[-2]))
        for name, mod in (("k_proj", last.self_attn.k_proj), ("mlp", last.mlp))
    ]
    try:
        res = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.2, strategy="hkvd"))
    finally:
        for h in hooks:
            h.remove()
    kept = int(res.selected[-1].numel())
    assert kept > 1
    assert rows == {"k_proj": 1, "mlp": 1}  # the last call: the last position's full layer
    assert res.stats["recomputed_per_layer"][-1] == kept and res.stats["computed_per_layer"][-1] == 1


def test_row_grouped_attention_is_exact(engine, monkeypatch):
    layout = engine.build_layout(Q, CHUNKS)
    one = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, attention_groups=1))
    many = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, attention_groups=7))
    assert [s.tolist() for s in one.selected] == [s.tolist() for s in many.selected]
    torch.testing.assert_close(many.logits, one.logits, rtol=1e-5, atol=1e-5)
    for i in range(engine.num_layers):
        for a, b in zip(_kv(many.cache, i), _kv(one.cache, i)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Control: blocks that stop one key short of their last row's position change the answer.
    import cacheblend_rag.blend.fusor as fusor

    short = lambda pos, g: [(a, b, e - 1) for a, b, e in row_groups(pos, g)]  # noqa: E731
    monkeypatch.setattr(fusor, "row_groups", short)
    cut = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, attention_groups=7))
    assert float((cut.logits - one.logits).abs().max()) > 1e-4


def test_row_groups_cover_rows_and_read_keys_up_to_their_last_position():
    pos = torch.tensor([2, 3, 5, 8, 9, 13, 21])
    blocks = row_groups(pos, 3)
    assert [(a, b) for a, b, _ in blocks] == [(0, 2), (2, 5), (5, 7)]
    assert [e for *_, e in blocks] == [4, 10, 22]
    assert row_groups(pos, 100) == [(i, i + 1, int(p) + 1) for i, p in enumerate(pos)]
    # Long runs of rows (the first layers recompute every candidate) get blocks of <= 512 rows.
    tail = torch.arange(300, 1500)
    assert [(a, b, e) for a, b, e in row_groups(tail, 2)] == [(0, 400, 700), (400, 800, 1100), (800, 1200, 1500)]
    with pytest.raises(ValueError, match="attention_groups"):
        BlendConfig(attention_groups=0)


def test_explicit_schedule_and_boundary_tokens(engine):
    layout = engine.build_layout(Q, CHUNKS)
    cfg = BlendConfig(schedule=((0, 0.5), (2, 0.1)), boundary_tokens=2, strategy="hkvd")
    res = engine.prefill(layout, "cacheblend", cfg)
    sizes = [int(s.numel()) for s in res.selected]
    assert sizes[1] == sizes[2] and sizes[2] > sizes[3]
    starts = layout.offsets()[2:-1]  # non-exact chunks
    for sel in res.selected:
        assert {s for off in starts for s in (off, off + 1)} <= set(sel.tolist())


def _prefix_kv_gap(engine, q_start_of, cfg):
    a = engine.prefill(engine.build_layout(Q, CHUNKS), "cacheblend", cfg)
    b = engine.prefill(engine.build_layout("Where is the Eiffel Tower?", CHUNKS), "cacheblend", cfg)
    q_start = a.layout.offsets()[-1]
    gap = 0.0
    for i in range(engine.num_layers):
        for x, y in zip(_kv(a.cache, i), _kv(b.cache, i)):
            gap = max(gap, float((x[:, :, :q_start] - y[:, :, :q_start]).abs().max()))
    return gap


def test_selected_tokens_never_see_later_tokens(engine, monkeypatch):
    # Two prompts that differ only in the question: every K/V before the question must match
    # (up to float rounding from the different batch shapes). A question-independent criterion,
    # so that both prompts recompute the same tokens.
    cfg = BlendConfig(recompute_ratio=0.3, criterion="value", strategy="hkvd")
    assert _prefix_kv_gap(engine, None, cfg) < 1e-5
    # Control: a mask that lets selected tokens see later ones makes the question leak in.
    import cacheblend_rag.blend.fusor as fusor

    monkeypatch.setattr(fusor, "causal_mask", lambda pos, n, dtype: torch.zeros(1, 1, len(pos), n, dtype=dtype))
    assert _prefix_kv_gap(engine, None, cfg) > 1e-3


def test_causal_mask_is_exact():
    pos = torch.tensor([3, 7, 9])
    m = causal_mask(pos, 10, torch.float32)[0, 0]
    assert m.shape == (3, 10)
    for r, p in enumerate(pos.tolist()):
        assert (m[r, : p + 1] == 0).all() and (m[r, p + 1 :] < -1e30).all()


@pytest.mark.parametrize("criterion", ["value", "key", "kv", "query", "query_value"])
def test_every_criterion_runs_and_moves_toward_full_prefill(engine, criterion):
    layout = engine.build_layout(Q, CHUNKS)
    full = engine.prefill(layout, "full_recompute").logits
    dist = {}
    for r in (0.0, 1.0):
        res = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=r, criterion=criterion, strategy="hkvd"))
        dist[r] = float((res.logits - full).abs().max())
    assert dist[1.0] < 1e-4 < dist[0.0]


def test_misses_are_computed_stored_and_hit_next_time(engine):
    first = engine.generate(Q, CHUNKS, max_new_tokens=3)
    engine.flush()
    second = engine.generate(Q, CHUNKS, max_new_tokens=3)
    assert (first.stats["chunk_misses"], first.stats["chunk_hits"]) == (len(CHUNKS), 0)
    assert (second.stats["chunk_misses"], second.stats["chunk_hits"]) == (0, len(CHUNKS))
    assert first.text == second.text and first.token_ids == second.token_ids
    assert 0 < second.ttft_s <= second.total_s


def test_precompute_is_idempotent_and_makes_hits(engine):
    assert engine.precompute(CHUNKS + CHUNKS[:1], progress=False) == len(CHUNKS)
    assert engine.precompute(CHUNKS, progress=False) == 0
    assert all(engine.is_cached(c) for c in CHUNKS)
    res = engine.prefill(engine.build_layout(Q, CHUNKS), "cacheblend")
    assert res.stats["chunk_hits"] == len(CHUNKS) and res.stats["chunk_misses"] == 0


def test_generation_matches_transformers_greedy(engine):
    layout = engine.build_layout(Q, CHUNKS)
    res = engine.generate(Q, CHUNKS, mode="full_recompute", max_new_tokens=6)
    ids = torch.tensor([layout.token_ids])
    with torch.inference_mode():
        ref = engine.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    want = ref[0, ids.shape[1] :].tolist()
    assert len(want) == 6  # the reference ran to the limit, so the whole answer is compared
    eos = eos_token_ids(engine.model, engine.tokenizer)
    # The engine stops at its first EOS and leaves it out; up to there the answers are the same.
    stop = next((i for i, t in enumerate(want) if t in eos), None)
    assert res.token_ids == want[:stop] and res.token_ids, "nothing compared: the reference starts with EOS"
    assert res.finish_reason == ("length" if stop is None else "stop")


def test_streaming_stop_strings_and_sampling(engine):
    chunks = []
    stream = engine.stream(Q, CHUNKS, max_new_tokens=12)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text
    full = stream.result.text
    assert len(full) > 2
    stop = full[2:4]
    res = engine.generate(Q, CHUNKS, max_new_tokens=12, stop=[stop], on_token=chunks.append)
    assert stop not in res.text and res.text == full[: full.find(stop)] and "".join(chunks) == res.text
    assert res.finish_reason == "stop"
    s1 = engine.generate(Q, CHUNKS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    s2 = engine.generate(Q, CHUNKS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert s1.token_ids == s2.token_ids


def test_pipelined_loading_is_bit_identical(engine):
    layout = engine.build_layout(Q, CHUNKS)
    engine.precompute(CHUNKS, progress=False)
    a = engine.prefill(layout, "cacheblend", pipelined=False)
    b = engine.prefill(layout, "cacheblend", pipelined=True)
    assert torch.equal(a.logits, b.logits)
    for i in range(engine.num_layers):
        for x, y in zip(_kv(a.cache, i), _kv(b.cache, i)):
            assert torch.equal(x, y)


@pytest.mark.parametrize(
    "question, chunks, kwargs, error, message",
    [
        ("", CHUNKS, {}, ValueError, "question is empty"),
        ("   ", CHUNKS, {}, ValueError, "question is empty"),
        (Q, [], {}, ValueError, "no chunks given"),
        (Q, "one string", {}, TypeError, "list of strings"),
        (Q, ["ok", "  \n"], {}, ValueError, "chunk 1 is empty"),
        (Q, ["ok", 3], {}, TypeError, "chunk 1 is a int"),
        (Q, CHUNKS, {"mode": "fast"}, ValueError, "unknown mode 'fast'"),
        (Q, CHUNKS, {"recompute_ratio": 1.5}, ValueError, "recompute_ratio=1.5"),
        (Q, CHUNKS, {"max_new_tokens": 0}, ValueError, "max_new_tokens=0"),
        (Q, CHUNKS, {"max_new_tokens": "5"}, TypeError, "max_new_tokens must be an int"),
        (Q, CHUNKS, {"stop": 5}, TypeError, "stop must be a string or a list of strings"),
        (Q, CHUNKS, {"top_k": -1}, ValueError, "top_k=-1 must be >= 0"),
        (Q, CHUNKS, {"seed": "x"}, TypeError, "seed must be an int"),
        (Q, ["word " * 900], {}, ValueError, "more than the model's context window"),
    ],
)
def test_bad_input_gets_a_clear_error(engine, question, chunks, kwargs, error, message):
    with pytest.raises(error, match=message):
        engine.generate(question, chunks, **kwargs)


def test_duplicate_chunks_are_dropped(engine):
    a = engine.build_layout(Q, CHUNKS + CHUNKS[:2])
    b = engine.build_layout(Q, CHUNKS)
    assert a.token_ids == b.token_ids


def test_unknown_criterion_is_named(engine):
    with pytest.raises(ValueError, match="unknown selection criterion 'magic'"):
        engine.prefill(engine.build_layout(Q, CHUNKS), "cacheblend", BlendConfig(criterion="magic"))
