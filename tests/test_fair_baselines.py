"""The baselines CacheBlend is measured against, made as fast as they can be without changing a bit
of their output: prefix caching (cached prefix adopted, suffix through the causal kernel, write-back
off the answer's path) and full prefill with the fused modes' last-layer saving (``full_recompute_saved``).

Attention work is counted as the score elements SDPA is asked for: query rows x keys per head,
and for a causal call (``is_causal``, no mask) the causal triangle alone, which is what the full
prefill's kernel needs; every attention call, the model's own forward and the fusor's, goes
through ``torch.nn.functional.scaled_dot_product_attention`` on these models.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION

Q, CHUNKS = SAMPLE_QUESTION, SAMPLE_CHUNKS
TOL = dict(rtol=1e-4, atol=1e-5)  # as test_engine.py's exactness checks


class AttentionWork:
    """Counts attention score elements (summed over heads) of every SDPA call, per call."""

    def __init__(self, monkeypatch):
        self.calls: list[int] = []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def counting(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            heads, rows, keys = query.shape[1], query.shape[-2], key.shape[-2]
            if is_causal:
                assert attn_mask is None and rows == keys  # top-left causal: the full triangle
                self.calls.append(heads * rows * (rows + 1) // 2)
            else:
                self.calls.append(heads * rows * keys)
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)

    def run(self, fn):
        self.calls.clear()
        out = fn()
        return out, sum(self.calls)


def _assert_same(res, ref, num_layers):
    torch.testing.assert_close(res.logits, ref.logits, **TOL)
    for i in range(num_layers):
        a, b = res.cache.layers[i], ref.cache.layers[i]
        torch.testing.assert_close(a.keys, b.keys, **TOL)
        torch.testing.assert_close(a.values, b.values, **TOL)


def test_saved_full_prefill_equals_the_plain_forward_and_does_less_attention(engine, monkeypatch):
    layout = engine.build_layout(Q, CHUNKS)
    work = AttentionWork(monkeypatch)
    plain, plain_work = work.run(lambda: engine.prefill(layout, "full_recompute"))
    saved, saved_work = work.run(lambda: engine.prefill(layout, "full_recompute_saved"))
    _assert_same(saved, plain, engine.num_layers)
    n, heads = len(layout), engine.model.config.num_attention_heads
    triangle = heads * n * (n + 1) // 2
    assert plain_work == engine.num_layers * triangle
    # Layers 0..n-2 as the plain forward; the last layer: one row over every key.
    assert saved_work == (engine.num_layers - 1) * triangle + heads * n
    assert saved.stats["computed_per_layer"] == [n] * (engine.num_layers - 1) + [1]
    assert saved.stats["recomputed_per_layer"] == [n] * engine.num_layers
    assert saved.stats["chunk_hits"] == saved.stats["chunk_misses"] == 0


def test_saved_full_prefill_runs_the_last_layer_for_the_last_position_only(engine):
    layout = engine.build_layout(Q, CHUNKS)
    last = engine.model.model.layers[-1]
    rows: dict[str, list[int]] = {"k_proj": [], "mlp": [], "o_proj": []}
    hooks = [
        mod.register_forward_hook(lambda m, args, out, name=name: rows[name].append(args[0].shape[-2]))
        for name, mod in (("k_proj", last.self_attn.k_proj), ("mlp", last.mlp), ("o_proj", last.self_attn.o_proj))
    ]
    try:
        engine.prefill(layout, "full_recompute_saved")
    finally:
        for h in hooks:
            h.remove()
    # Every position's K/V (the capture pass), then the last position's whole layer; attention's
    # output projection and the MLP never see the other positions.
    assert rows == {"k_proj": [len(layout), 1], "mlp": [1], "o_proj": [1]}


def test_saved_full_prefill_answers_like_full_recompute_and_stores_nothing(engine):
    kw = dict(max_new_tokens=6, temperature=0.0)
    plain = engine.generate(Q, CHUNKS, mode="full_recompute", **kw)
    saved = engine.generate(Q, CHUNKS, mode="full_recompute_saved", **kw)
    assert saved.token_ids == plain.token_ids
    engine.flush()
    assert not any(engine.is_cached(c) for c in CHUNKS)


@pytest.mark.parametrize("cached", ["none", "first_chunk", "all_but_question"])
def test_prefix_caching_is_exact_and_does_no_more_attention_than_full_prefill(engine, monkeypatch, cached):
    layout = engine.build_layout(Q, CHUNKS)
    if cached == "first_chunk":  # the instruction and the first chunk, written back by a shorter prompt
        engine.prefill(engine.build_layout(Q, CHUNKS[:1]), "prefix_caching")
    elif cached == "all_but_question":
        engine.prefill(layout, "prefix_caching")
    engine.flush()
    work = AttentionWork(monkeypatch)
    plain, plain_work = work.run(lambda: engine.prefill(layout, "full_recompute"))
    saved, saved_work = work.run(lambda: engine.prefill(layout, "full_recompute_saved"))
    prefix, prefix_work = work.run(lambda: engine.prefill(layout, "prefix_caching"))
    _assert_same(prefix, plain, engine.num_layers)
    reused = prefix.stats["reused_prefix_tokens"]
    assert prefix_work <= saved_work <= plain_work
    if cached == "all_but_question":
        assert reused == len(layout) - len(layout.segments[-1]) and prefix_work < saved_work
    print(
        f"attention work ({cached}, {len(layout)} tokens, {reused} reused): full {plain_work}, "
        f"full saved {saved_work}, prefix caching {prefix_work}"
    )


def test_prefix_caching_writes_back_on_the_writer_thread(engine, monkeypatch):
    layout = engine.build_layout(Q, CHUNKS)
    threads: list[str] = []
    put = engine.store.put

    def recording(key, kv):
        threads.append(threading.current_thread().name)
        return put(key, kv)

    monkeypatch.setattr(engine.store, "put", recording)
    first = engine.prefill(layout, "prefix_caching")
    engine.flush()
    assert len(threads) == len(first.stats["writeback_keys"]) == len(layout.segments) - 1
    assert all(name.startswith("cacheblend-writeback") for name in threads)
    # What was written back is what the answer used: the next prompt reuses it exactly.
    second = engine.prefill(layout, "prefix_caching")
    _assert_same(second, first, engine.num_layers)
    assert second.stats["chunk_hits"] == len(CHUNKS)


def test_bench_runs_the_saved_full_prefill_and_reports_the_ratio_to_it():
    from cacheblend_bench.methods import parse_methods
    from cacheblend_bench.summary import markdown_table, summarize

    (m,) = parse_methods(["full_recompute_saved"])
    assert (m.name, m.kind, m.mode) == ("full_recompute_saved", "kv", "full_recompute_saved")

    def row(method, ttft):
        return {
            "dataset": "d",
            "top_k": 6,
            "method": method,
            "qid": "a",
            "ttft_s": ttft,
            "total_s": ttft,
            "quality": 0.0,
            "metric": "f1",
            "answer": "x",
        }

    blend = dict(row("cacheblend@0.15", 1.0), compute_fraction=0.25)
    saved = dict(row("full_recompute_saved", 2.0), compute_fraction=1.0)
    summary = summarize([row("full_recompute", 3.0), saved, blend])
    by = {s["method"]: s for s in summary}
    assert by["cacheblend@0.15"]["speedup_vs_full_recompute_saved"] == pytest.approx(2.0)
    # 1 s for a quarter of the saved full prefill's 2 s of work: twice its share.
    assert by["cacheblend@0.15"]["overhead"] == pytest.approx(2.0)
    assert "| cacheblend@0.15 | 1 | f1 0.000 | 3.00x | 2.00x |" in markdown_table(summary, "d", 6)


def test_prefix_caching_recomputes_a_segment_lost_during_the_load(engine, monkeypatch):
    layout = engine.build_layout(Q, CHUNKS)
    ref = engine.prefill(layout, "full_recompute")
    engine.prefill(layout, "prefix_caching")
    engine.flush()
    lost = engine.chunk_key(engine.prompts.chunk_segment(CHUNKS[0]))  # cached behind the instruction
    get_layer = engine.store.get_layer
    asked: list[str] = []

    def failing(key, layer, **kw):
        asked.append(key)
        return None if key == lost else get_layer(key, layer, **kw)

    monkeypatch.setattr(engine.store, "get_layer", failing)
    res = engine.prefill(layout, "prefix_caching")
    _assert_same(res, ref, engine.num_layers)
    assert lost in asked
    assert res.stats["reused_prefix_tokens"] in (0, len(layout.segments[0]))  # the instruction at most
