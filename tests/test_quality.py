"""Question-guided selection and neighbour-aware chunk caches, checked against full prefill and
brute-force references on tiny random models."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig, CacheBlendEngine
from cacheblend_rag.blend.fusor import causal_mask
from cacheblend_rag.blend.selector import pick_chunks, pick_tokens
from cacheblend_rag.model.attention import PROBE_KWARG, AttentionProbe, blend_attention_forward
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_model

CHUNKS = SAMPLE_CHUNKS
Q = SAMPLE_QUESTION


def _kv(cache, layer):
    return cache.layers[layer].keys, cache.layers[layer].values


@pytest.fixture(params=["llama", "qwen2", "qwen2-7to1"])
def qengine(request, tokenizer, tmp_path):
    # qwen2-7to1: Qwen2.5-0.5B's head layout (7 query heads per K/V head) with q/k/v biases.
    arch, over = (
        ("qwen2", dict(hidden_size=56, num_attention_heads=7, num_key_value_heads=1))
        if request.param == "qwen2-7to1"
        else (request.param, {})
    )
    eng = CacheBlendEngine(make_model(arch, **over), tokenizer, store=KVStore(tmp_path / "kv"), pipelined=False)
    eng.precompute(CHUNKS, progress=False)
    yield eng
    eng.close()


@pytest.mark.parametrize("strategy", ["question", "chunk", "hybrid"])
def test_guided_ratio_one_equals_full_prefill(qengine, strategy):
    layout = qengine.build_layout(Q, CHUNKS)
    full = qengine.prefill(layout, "full_recompute")
    guided = qengine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=1.0, strategy=strategy))
    torch.testing.assert_close(guided.logits, full.logits, rtol=1e-4, atol=1e-5)
    for i in range(qengine.num_layers):
        for a, b in zip(_kv(guided.cache, i), _kv(full.cache, i)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", ["question", "chunk", "hybrid"])
def test_guided_ratio_zero_equals_full_reuse(qengine, strategy):
    layout = qengine.build_layout(Q, CHUNKS)
    reuse = qengine.prefill(layout, "full_reuse")
    guided = qengine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.0, strategy=strategy))
    torch.testing.assert_close(guided.logits, reuse.logits, rtol=1e-5, atol=1e-6)
    assert guided.stats["recomputed_per_layer"] == reuse.stats["recomputed_per_layer"]
    # Something between the two is really different from both (the test could otherwise pass on
    # a strategy that ignored the ratio).
    mid = qengine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.4, strategy=strategy))
    assert not torch.allclose(mid.logits, reuse.logits)


def _brute_force_question_attention(engine, layout, layers: str) -> torch.Tensor:
    """The question's attention to every position, from transformers' eager attention: the
    question tokens run over the reused (full-reuse) K/V of the context."""
    reuse = engine.prefill(layout, "full_reuse")
    q_start = layout.offsets()[-1]
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(engine.num_layers):
        k, v = _kv(reuse.cache, i)
        cache.update(k[:, :, :q_start].clone(), v[:, :, :q_start].clone(), i)
    eager = make_model(engine.model.config.model_type, **_dims(engine.model.config))
    eager.load_state_dict(engine.model.state_dict())
    eager.set_attn_implementation("eager")
    ids = torch.tensor([layout.token_ids[q_start:]])
    with torch.inference_mode():
        out = eager(
            input_ids=ids,
            position_ids=torch.arange(q_start, len(layout))[None],
            cache=cache,
            use_cache=True,
            output_attentions=True,
        )
    per_layer = [a[0].mean(dim=(0, 1)) for a in out.attentions]  # [L] each: mean over heads, rows
    return per_layer[-1] if layers == "last" else torch.stack(per_layer).mean(0)


def _dims(cfg) -> dict:
    return dict(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads
    )


@pytest.mark.parametrize("layers", ["all", "last"])
def test_question_selects_the_tokens_with_most_question_attention(qengine, layers):
    layout = qengine.build_layout(Q, CHUNKS)
    cfg = BlendConfig(recompute_ratio=0.3, strategy="question", question_layers=layers)
    res = qengine.prefill(layout, "cacheblend", cfg)
    scores = _brute_force_question_attention(qengine, layout, layers)
    offsets = layout.offsets()
    first, q_start = offsets[2], offsets[-1]  # chunk 1 sits right after the prefix: exact, never picked
    k = -(-3 * layout.num_context_tokens // 10)  # ceil(0.3 * context tokens)
    expected = first + torch.topk(scores[first:q_start], k).indices
    picked = res.selected[0][res.selected[0] < q_start]
    assert picked.tolist() == sorted(expected.tolist())
    # Selected once, recomputed on every layer.
    assert all(torch.equal(s, res.selected[0]) for s in res.selected[:-1])


@pytest.mark.parametrize("probed", [5, 2])
def test_probe_scores_and_output_are_masked_grouped_attention(probed):
    """The scoring pass's probe: its weights are the softmax over the mask averaged over heads and
    probed rows; with ``attend`` and every row probed, the layer's attention output comes from
    those probabilities, otherwise SDPA runs; either way it is SDPA's output."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 5, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)  # 3 query heads per K/V head
    mask = causal_mask(torch.tensor([3, 5, 8, 10, 11]), 12, torch.float32)  # [1, 1, 5, 12]
    probe = AttentionProbe(probed, attend=True)
    out, _ = blend_attention_forward(None, q, k, v, mask, scaling=None, dropout=0.0, **{PROBE_KWARG: probe})
    k3, v3 = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k3, v3, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert (probe.output is not None) == (probed == 5)
    probs = (q @ k3.transpose(-1, -2) / 8**0.5 + mask).softmax(-1)[:, :, -probed:]  # [1, heads, probed, keys]
    torch.testing.assert_close(probe.weights, probs.mean(dim=(0, 1, 2)))
    torch.testing.assert_close(probe.group_weights, probs[0].mean(dim=1).view(2, 3, -1).mean(dim=1))


@pytest.mark.parametrize("strategy,layers", [("question", "all"), ("question", "last"), ("chunk", "all"), ("hybrid", "all")])
def test_chunk_attention_is_the_question_attention_summed_per_chunk(qengine, strategy, layers):
    """stats["chunk_attention"]: the scoring pass's attention (checked against eager attention)
    summed over each chunk's tokens and normalised over the chunks, in prompt order."""
    layout = qengine.build_layout(Q, CHUNKS)
    res = qengine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, strategy=strategy, question_layers=layers))
    scores = _brute_force_question_attention(qengine, layout, layers)
    offsets = layout.offsets()
    mass = torch.stack([scores[offsets[j] : offsets[j + 1]].sum() for j in range(1, len(offsets) - 1)])
    shares = res.stats["chunk_attention"]
    assert len(shares) == len(CHUNKS) and sum(shares) == pytest.approx(1.0)
    torch.testing.assert_close(torch.tensor(shares, dtype=torch.float64), (mass / mass.sum()).double(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "mode,config",
    [
        ("full_recompute", None),
        ("full_recompute_saved", None),
        ("prefix_caching", None),
        ("full_reuse", None),
        ("cacheblend", BlendConfig(strategy="hkvd")),
    ],
)
def test_chunk_attention_is_absent_where_no_scoring_pass_runs(qengine, mode, config):
    res = qengine.generate(Q, CHUNKS, mode=mode, config=config, max_new_tokens=2)
    assert "chunk_attention" not in res.stats


def test_reporting_chunk_attention_changes_no_answer(qengine, monkeypatch):
    import cacheblend_rag.engine.prefill as prefill_module

    layout = qengine.build_layout(Q, CHUNKS)
    with_it = qengine.prefill(layout, "cacheblend")
    answer = qengine.generate(Q, CHUNKS, max_new_tokens=8)
    monkeypatch.setattr(prefill_module, "chunk_attention", lambda scores, layout: [])  # not computed at all
    without = qengine.prefill(layout, "cacheblend")
    assert torch.equal(with_it.logits, without.logits)
    assert all(torch.equal(a, b) for a, b in zip(with_it.selected, without.selected))
    assert qengine.generate(Q, CHUNKS, max_new_tokens=8).token_ids == answer.token_ids
    assert len(answer.stats["chunk_attention"]) == len(CHUNKS) and without.stats["chunk_attention"] == []


def test_hybrid_narrows_the_question_seed_on_layer_one(qengine):
    layout = qengine.build_layout(Q, CHUNKS)
    q_start = layout.offsets()[-1]
    k = -(-3 * layout.num_context_tokens // 10)  # ceil(0.3 * context tokens)

    def context(sel):
        return sel[sel < q_start].tolist()

    seed_ratio = (2 * k - 0.5) / layout.num_context_tokens  # "question" at exactly 2k tokens
    seed = qengine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=seed_ratio, strategy="question"))
    hybrid = qengine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, strategy="hybrid", hybrid_seed=2.0))
    # Layers 0-1 recompute the question's top two budgets; from layer 2 on, k of them remain.
    assert context(hybrid.selected[0]) == context(hybrid.selected[1]) == context(seed.selected[0])
    kept = context(hybrid.selected[2])
    assert len(kept) == k and set(kept) <= set(context(seed.selected[0]))
    # A seed of one budget leaves the check nothing to drop: "question"'s own prefill.
    one = qengine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, strategy="hybrid", hybrid_seed=1.0))
    question = qengine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, strategy="question"))
    assert [s.tolist() for s in one.selected] == [s.tolist() for s in question.selected]
    torch.testing.assert_close(one.logits, question.logits, rtol=1e-5, atol=1e-6)


def test_pick_tokens_window_and_chunks_budget():
    scores = torch.tensor([0.0, 0.1, 0.9, 0.1, 0.0, 0.0, 0.5, 0.0])
    cand = torch.ones(8, dtype=torch.bool)
    assert pick_tokens(scores, cand, 2).tolist() == [2, 6]
    assert pick_tokens(scores, cand, 3, window=1).tolist() == [1, 2, 3]  # the peak's neighbours first
    cand[2] = False
    assert 2 not in pick_tokens(scores, cand, 3).tolist()
    spans = [(0, 4), (4, 8), (8, 10)]
    mass = torch.tensor([0.1] * 4 + [0.5] * 4 + [0.3] * 2)
    assert pick_chunks(mass, spans, budget=1) == [1]  # the best chunk even over budget
    assert pick_chunks(mass, spans, budget=6) == [1, 2]
    assert pick_chunks(mass, spans, budget=10) == [0, 1, 2]


def _corpus(second: str) -> list[str]:
    return [CHUNKS[0], second, CHUNKS[2], CHUNKS[3]]


def _embed(texts: list[str]) -> torch.Tensor:
    # Deterministic toy embedding: bag of letters.
    return torch.stack([torch.bincount(torch.tensor([ord(c) % 32 for c in t.lower()]), minlength=32).float() for t in texts])


def _assert_cached_behind(eng, cache, layout, j: int, text: str, behind: list[str]) -> None:
    """Chunk ``j`` (``text``) of ``layout`` holds its K/V prefilled behind the instruction and
    ``behind`` (a manual prefill), moved to its place in the prompt."""
    from cacheblend_rag.rope import shift_keys

    seg = eng.prompts.chunk_segment(text)
    manual = eng.compute_chunk(seg, [eng.prompts.chunk_segment(t) for t in behind])
    off, plen = layout.offsets()[1 + j], len(eng.prompts.prefix_ids)
    for layer in (0, eng.num_layers - 1):
        k, v = _kv(cache, layer)
        torch.testing.assert_close(v[0, :, off : off + len(seg)], manual[layer][1])
        torch.testing.assert_close(
            k[0, :, off : off + len(seg)],
            shift_keys(eng.model.model.rotary_emb, manual[layer][0], off - plen),
            rtol=1e-4,
            atol=1e-5,
        )
    assert not torch.allclose(manual[-1][1], eng.compute_chunk(seg)[-1][1])  # layer 0 sees no context


def test_neighbour_caches_are_keyed_apart_and_hold_the_chunk_prefilled_behind_its_neighbours(qengine):
    eng = qengine
    computed = eng.precompute(CHUNKS, neighbours=2, embed=_embed, progress=False)
    assert computed == len(CHUNKS)  # plain caches existed; one neighbour-aware cache per chunk
    layout = eng.build_layout(Q, CHUNKS)
    plain = eng.prefill(layout, "full_reuse", BlendConfig(neighbour_caches=False))
    aware = eng.prefill(layout, "full_reuse")
    assert plain.stats["neighbour_hits"] == 0 and aware.stats["neighbour_hits"] == len(CHUNKS) - 1
    # The first chunk keeps its exact plain cache; the others hold K/V computed behind their
    # neighbours, which a manual prefill reproduces.
    from cacheblend_rag.neighbours.choice import nearest

    near = nearest(CHUNKS, 2, _embed)
    for j in range(1, len(CHUNKS)):
        _assert_cached_behind(eng, aware.cache, layout, j, CHUNKS[j], [CHUNKS[i] for i in near[j]])


def test_nearest_in_a_corpus_matches_brute_force():
    from cacheblend_rag.neighbours.choice import nearest

    corpus = [*CHUNKS, "Pierre Curie shared the first Nobel prize.", "Warsaw is the capital of Poland."]
    texts = [CHUNKS[1], CHUNKS[3], "A text that is not in the corpus."]
    emb = torch.nn.functional.normalize(_embed(corpus + texts[-1:]), dim=-1)
    for n in (1, 2, len(corpus)):
        got = nearest(texts, n, _embed, corpus=corpus)
        for i, t in enumerate(texts):
            e = emb[len(corpus)] if t not in corpus else emb[corpus.index(t)]
            others = sorted((j for j in range(len(corpus)) if corpus[j] != t), key=lambda j: (-float(e @ emb[j]), j))
            assert got[i] == list(reversed(others[:n]))  # most similar last, right in front of the chunk
    assert nearest(CHUNKS, 2, _embed) == nearest(CHUNKS, 2, _embed, corpus=CHUNKS)


def test_precompute_with_a_corpus_caches_only_the_texts_behind_neighbours_from_the_corpus(qengine):
    from cacheblend_rag.neighbours.choice import nearest

    eng = qengine
    extra = ["Marie Curie was born in Warsaw in 1867.", "The Sorbonne is a university in Paris."]
    corpus = [*CHUNKS, *extra]
    texts = CHUNKS[1:3]
    assert eng.precompute(texts, neighbours=2, embed=_embed, corpus=corpus, progress=False) == len(texts)
    assert not any(eng.is_cached(t) for t in extra)
    near = nearest(texts, 2, _embed, corpus=corpus)
    assert any(corpus[i] in extra for idx in near for i in idx)  # a neighbour only the corpus holds
    layout = eng.build_layout(Q, [CHUNKS[0], *texts])
    aware = eng.prefill(layout, "full_reuse")
    assert aware.stats["neighbour_hits"] == len(texts)
    for j, (text, idx) in enumerate(zip(texts, near), start=1):
        _assert_cached_behind(eng, aware.cache, layout, j, text, [corpus[i] for i in idx])
    with pytest.raises(TypeError, match=r"precompute's corpus= takes a list of chunk texts, got a single str"):
        eng.precompute(texts, neighbours=1, corpus="one text")
    with pytest.raises(ValueError, match="corpus 1 is empty or whitespace"):
        eng.precompute(texts, neighbours=1, corpus=[CHUNKS[0], " "])


def test_a_changed_neighbour_set_is_not_served(tokenizer, tmp_path):
    model = make_model("llama")
    old_corpus = _corpus(CHUNKS[1])
    new_corpus = _corpus("Marie Curie won two Nobel prizes; Pierre Curie shared the first one.")
    q_chunks = [CHUNKS[0], CHUNKS[2], CHUNKS[3]]  # chunks present in both corpora

    def engine(store_dir, *corpora):
        eng = CacheBlendEngine(model, tokenizer, store=KVStore(tmp_path / store_dir), pipelined=False)
        for corpus in corpora:
            eng.precompute(corpus, neighbours=1, embed=_embed, progress=False)
        return eng

    updated, fresh, stale = engine("a", old_corpus, new_corpus), engine("b", new_corpus), engine("c", old_corpus)
    logits = {}
    for name, eng in (("updated", updated), ("fresh", fresh), ("stale", stale)):
        layout = eng.build_layout(Q, q_chunks)
        logits[name] = eng.prefill(layout, "full_reuse").logits
        eng.close()
    torch.testing.assert_close(logits["updated"], logits["fresh"])
    assert not torch.allclose(logits["updated"], logits["stale"])


def test_bad_strategy_options_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="strategy='nope': choose one of hkvd, question, chunk"):
        BlendConfig(strategy="nope")
    with pytest.raises(ValueError, match="question_layers='first'"):
        BlendConfig(question_layers="first")
    with pytest.raises(ValueError, match="schedule= is HKVD's gradual filtering and strategy='question' would ignore it"):
        BlendConfig(schedule=((1, 0.5),), strategy="question")
    with pytest.raises(ValueError, match="hybrid_seed=0.5 must be a finite number >= 1"):
        BlendConfig(hybrid_seed=0.5)
    with pytest.raises(ValueError, match="selection_window=-1"):
        BlendConfig(selection_window=-1)


def test_precompute_neighbours_argument_is_checked(qengine):
    with pytest.raises(ValueError, match="neighbours=-1 must be an int >= 0"):
        qengine.precompute(CHUNKS, neighbours=-1)
    with pytest.raises(ValueError, match=r"embed returned shape \(2, 3\)"):
        qengine.precompute(CHUNKS, neighbours=1, embed=lambda t: torch.zeros(2, 3))


def _manual_attention(q, k, v, mask, spec, scaling):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) * scaling
    if spec is not None:
        s[..., spec.start : spec.end] = s[..., spec.start : spec.end] / spec.temperature + torch.log(torch.tensor(spec.scale))
    return ((s + mask).softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("rows", [None, 2])
def test_context_attention_reweights_the_chunk_keys_of_the_question_rows_only(rows):
    from cacheblend_rag.blend.fusor import causal_mask
    from cacheblend_rag.model.attention import APE_KWARG, ContextAttention, blend_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    positions = torch.tensor([3, 6, 9, 10, 11])
    mask = causal_mask(positions, 12, torch.float32)
    spec = ContextAttention(2, 9, temperature=0.8, scale=0.7, rows=rows)
    module = torch.nn.Module()
    got = blend_attention_forward(module, q, k, v, mask, scaling=8**-0.5, **{APE_KWARG: spec})[0]
    n = 5 if rows is None else rows
    expected = torch.cat(
        [
            _manual_attention(q[:, :, :-n], k, v, mask[:, :, :-n], None, 8**-0.5),
            _manual_attention(q[:, :, -n:], k, v, mask[:, :, -n:], spec, 8**-0.5),
        ],
        dim=1,
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="context_scale=0 must be a positive finite number"):
        BlendConfig(context_scale=0)


def test_ape_reweighting_reaches_decoding(qengine):
    """The reweighting is part of the prefill and of every decoded token: the greedy answer's
    tokens are those a manual decode with the same attention keywords picks."""
    cfg = BlendConfig(recompute_ratio=0.0, strategy="question", context_temperature=0.5, context_scale=3.0)
    stream = qengine.stream(Q, CHUNKS, config=cfg, max_new_tokens=4)
    tokens = []
    for _ in stream:
        pass
    pre = stream.prefill_result
    assert pre.attention_kwargs, "the prefill hands its reweighting to decoding"
    plain = qengine.prefill(qengine.build_layout(Q, CHUNKS), "cacheblend", BlendConfig(recompute_ratio=0.0, strategy="question"))
    assert not torch.allclose(pre.logits, plain.logits)
    fresh = qengine.prefill(qengine.build_layout(Q, CHUNKS), "cacheblend", cfg)
    # The keywords change a decoding step (else this test could not see decoding ignore them).
    step = {"input_ids": torch.tensor([[int(fresh.logits.argmax())]]), "position_ids": torch.tensor([[len(fresh.layout)]])}
    with torch.inference_mode():
        a = qengine.model(**step, cache=qengine.prefill(fresh.layout, "cacheblend", cfg).cache, **fresh.attention_kwargs).logits
        b = qengine.model(**step, cache=qengine.prefill(fresh.layout, "cacheblend", cfg).cache).logits
    assert not torch.allclose(a, b)
    logits, pos = fresh.logits, len(fresh.layout)
    for _ in range(len(stream.result.token_ids)):
        tokens.append(int(logits.argmax()))
        with torch.inference_mode():
            out = qengine.model(
                input_ids=torch.tensor([[tokens[-1]]]),
                position_ids=torch.tensor([[pos]]),
                use_cache=True,
                cache=fresh.cache,
                **fresh.attention_kwargs,
            )
        logits, pos = out.logits[0, -1], pos + 1
    assert tokens == stream.result.token_ids
