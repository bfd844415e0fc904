"""The fidelity benchmark: its metrics against brute-force references, and a small real run."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from cacheblend_bench.fidelity import (
    FidelityConfig,
    TeacherForced,
    agreement_f1,
    bootstrap_mean_ci,
    first_token_margin,
    neighbours_in_prompt,
    run_fidelity,
    summarize,
    teacher_forced,
)
from cacheblend_bench.methods import parse_methods
from cacheblend_rag import BlendConfig
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION


def test_teacher_forcing_equals_a_full_forward_over_prompt_and_answer(engine):
    layout = engine.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    pre = engine.prefill(layout, "full_recompute")
    target = [5, 77, 123, 9]
    got = teacher_forced(engine, pre.cache, pre.logits, len(layout), target)
    ids = torch.tensor([list(layout.token_ids) + target])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(layout) - 1 :], -1)  # [len(target) + 1, vocab]
    expected = float(lp[:-1].gather(1, torch.tensor(target)[:, None]).mean())
    assert got.loglik == pytest.approx(expected, abs=1e-4)
    top = lp.topk(2, dim=-1)
    assert got.choices == top.indices[:, 0].tolist()
    assert got.margins == pytest.approx((top.values[:, 0] - top.values[:, 1]).tolist(), abs=1e-4)
    # A cache that decoding already extended is cropped back to the prompt first.
    engine.model(
        input_ids=torch.tensor([[7, 8]]),
        position_ids=torch.tensor([[len(layout), len(layout) + 1]]),
        use_cache=True,
        cache=pre.cache,
    )
    assert teacher_forced(engine, pre.cache, pre.logits, len(layout), target).loglik == pytest.approx(expected, abs=1e-4)


def test_a_cache_leaves_the_answer_where_its_greedy_choice_differs():
    tf = TeacherForced(loglik=-1.0, margins=[1.0, 0.1, 2.0, 0.5], choices=[4, 5, 6, 2])
    assert tf.leaves([4, 5, 6], ended=False, eos={2}) == []
    assert tf.leaves([4, 5, 6], ended=True, eos={2}) == []  # it chose end of sequence too
    assert tf.leaves([4, 5, 6], ended=True, eos={3}) == [3]  # it would have gone on
    assert tf.leaves([4, 9, 7], ended=False, eos={2}) == [1, 2]


def test_first_token_margin_is_the_log_probability_gap_of_the_top_two():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    logp = torch.log_softmax(logits, -1)
    assert first_token_margin(logits) == pytest.approx(float(logp[1] - logp[2]))
    assert first_token_margin(torch.tensor([3.0, 3.0])) == 0.0


def test_agreement_and_bootstrap():
    assert agreement_f1("The Thames.", "thames") == 1.0
    assert agreement_f1("", "") == 1.0
    assert agreement_f1("river Thames", "Thames") == pytest.approx(2 / 3)
    lo, hi = bootstrap_mean_ci([0.0, 1.0] * 50)
    assert lo < 0.5 < hi and hi - lo < 0.25
    assert bootstrap_mean_ci([0.2] * 10) == pytest.approx((0.2, 0.2))
    assert all(math.isnan(x) for x in bootstrap_mean_ci([1.0]))


def test_method_specs_with_strategies_and_options():
    names = [m.name for m in parse_methods(["question@0.15/last/w2/nb", "chunk@0.3", "full_reuse/nb", "hkvd@0.15", "hybrid@0.2"])]
    assert names == ["question@0.15/last/w2/nb", "chunk@0.3", "full_reuse/nb", "cacheblend@0.15", "hybrid@0.2"]
    assert parse_methods(["hybrid@0.2"])[0].blend_config(BlendConfig()).strategy == "hybrid"
    m = parse_methods(["question@0.15/last/w2/nb"])[0]

    cfg = m.blend_config(BlendConfig())
    assert (cfg.strategy, cfg.question_layers, cfg.selection_window, cfg.neighbour_caches) == ("question", "last", 2, True)
    assert parse_methods(["full_reuse"])[0].blend_config(BlendConfig()).neighbour_caches is False
    assert parse_methods(["question@0.15/b16/nb"])[0].blend_config(BlendConfig()).boundary_tokens == 16
    with pytest.raises(ValueError, match="unknown option 'deep'"):
        parse_methods(["question@0.15/deep"])
    with pytest.raises(ValueError, match="need neighbour-aware caches: pass --neighbours"):
        FidelityConfig(methods=("question@0.15/nb",), neighbours=0)
    with pytest.raises(ValueError, match="engine prefill modes only"):
        FidelityConfig(methods=("map_reduce",))


def test_fidelity_run_scores_an_exact_method_as_agreeing(tmp_path, monkeypatch):
    from cacheblend_bench import fidelity
    from cacheblend_bench.runner import tiny_engine

    engine = tiny_engine(str(tmp_path / "kv"))
    cfg = FidelityConfig(
        model="tiny",
        datasets=("hotpotqa",),
        n=1,
        methods=("full_reuse", "question@1", "question@0.2/nb"),
        neighbours=1,
        max_new_tokens=4,
        out_dir=str(tmp_path / "out"),
        progress=False,
        plots=False,
    )
    answered = []  # (method, question, first-token logits) of every answer the run computed
    real_answer = fidelity.answer_once

    def spy(engine, method, question, chunks, budget, **kw):
        got = real_answer(engine, method, question, chunks, budget, **kw)
        answered.append((method.name, question, got["prefill"].logits.reshape(-1).clone()))
        return got

    monkeypatch.setattr(fidelity, "answer_once", spy)
    try:
        rows = run_fidelity(cfg, engine=engine)
    finally:
        engine.close()
    by = {r["method"]: r for r in rows}
    exact = by["question@1"]
    assert exact["agree"] and exact["agree_f1"] == 1.0 and exact["kl"] < 1e-6
    assert exact["tf_loglik"] == pytest.approx(exact["tf_loglik_full"], abs=1e-4)
    assert exact["tf_leaves"] == [] and exact["tf_margins"] == pytest.approx(exact["tf_margins_full"], abs=1e-3)
    # Greedy decoding leaves full prefill's answer where teacher forcing says it does.
    for r in rows:
        assert (r["tf_leaves"] == []) == (r["answer"] == r["answer_full"]), r["method"]
    assert by["question@0.2/nb"]["neighbour_hits"] > 0 and by["full_reuse"]["neighbour_hits"] == 0
    assert by["full_reuse"]["kl"] > 1e-6
    summary = {e["method"]: e for e in summarize(rows) if e["dataset"] == "all"}
    assert summary["full_reuse"]["kl_vs_reuse"] == pytest.approx(1.0)
    assert summary["question@1"]["kl_worse_than_reuse"] == 0.0
    # Agreement on the questions where full prefill's first token clearly led its runner-up.
    # Each row's margin is full prefill's for its question (not the method's own, which differs
    # for full reuse).
    full_logits = {q: logits for name, q, logits in answered if name == "full_recompute"}
    reuse_logits = {q: logits for name, q, logits in answered if name == "full_reuse"}
    own_logits = {(name, q): logits for name, q, logits in answered}
    for r in rows:
        assert r["margin_full"] == pytest.approx(first_token_margin(full_logits[r["question"]]), abs=1e-6)
        assert r["margin_full"] != pytest.approx(first_token_margin(reuse_logits[r["question"]]), abs=1e-6)
        # ``margin`` is the method's own (what the fidelity guard reads: bench.guard_curve).
        assert r["margin"] == pytest.approx(first_token_margin(own_logits[r["method"], r["question"]]), abs=1e-6)
    confident = [r for r in rows if r["method"] == "full_reuse" and r["margin_full"] >= math.log(2)]
    assert summary["full_reuse"]["n_confident"] == len(confident)
    if confident:
        assert summary["full_reuse"]["agree_confident"] == pytest.approx(sum(r["agree"] for r in confident) / len(confident))
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {e["method"] for e in saved["summary"]} == set(by)
    assert {(c["a"], c["b"]) for c in saved["comparisons"]} == {
        ("full_reuse", "question@1"),
        ("full_reuse", "question@0.2/nb"),
        ("question@1", "question@0.2/nb"),
    }
    # Resumable: a second run finds every question finished, loads no model, and can plot.
    assert len(run_fidelity(replace(cfg, plots=True), engine=None)) == len(rows)
    assert (tmp_path / "out" / "plots" / "fidelity_tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {r["answer_hint"] for r in rows} == {""}
    with pytest.raises(ValueError, match="measured with answer_hint='', not 'Be brief.'"):
        run_fidelity(replace(cfg, answer_hint="Be brief."), engine=None)


def test_neighbours_in_prompt_counts_the_neighbours_that_are_chunks_of_the_prompt():
    # Toy embedding: a number as an angle, so that cosine similarity falls with the distance.
    embed = lambda texts: torch.tensor([[math.cos(0.02 * float(t)), math.sin(0.02 * float(t))] for t in texts])  # noqa: E731
    pool = [str(x) for x in (0, 1, 2, 10, 11, 30)]
    assert neighbours_in_prompt(["0", "1", "2"], pool, 2, embed) == 1.0  # each one's 2 nearest are the other two
    # "10" -> 11, 2; "11" -> 10, 2; "30" -> 11, 10: four of the six neighbours are in the prompt.
    assert neighbours_in_prompt(["10", "11", "30"], pool, 2, embed) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="neighbour_pool='all': choose one of retrieved, corpus"):
        FidelityConfig(neighbour_pool="all")


def test_fidelity_with_corpus_neighbours_records_the_pool_and_keeps_it_apart(tmp_path):
    from cacheblend_bench.runner import tiny_engine

    engine = tiny_engine(str(tmp_path / "kv"))
    cfg = FidelityConfig(
        model="tiny",
        datasets=("hotpotqa",),
        n=2,
        methods=("full_reuse", "full_reuse/nb"),
        neighbours=1,
        neighbour_pool="corpus",
        max_new_tokens=2,
        out_dir=str(tmp_path / "out"),
        progress=False,
        plots=False,
    )
    try:
        rows = run_fidelity(cfg, engine=engine)
    finally:
        engine.close()
    assert len(rows) == 4 and {r["neighbour_pool"] for r in rows} == {"corpus"}
    assert all(0.0 <= r["neighbours_in_prompt"] <= 1.0 for r in rows)
    assert all(r["neighbour_hits"] == r["num_chunks"] - 1 for r in rows if r["method"] == "full_reuse/nb")
    with pytest.raises(
        ValueError, match="measured with neighbour_pool='corpus', not 'retrieved': pass the same --neighbour-pool"
    ):
        run_fidelity(replace(cfg, neighbour_pool="retrieved"), engine=None)


def test_a_method_added_to_a_finished_run_reuses_full_prefills_answer(tmp_path, monkeypatch):
    from cacheblend_bench import fidelity
    from cacheblend_bench.runner import tiny_engine

    cfg = FidelityConfig(
        model="tiny",
        datasets=("hotpotqa",),
        n=2,
        methods=("full_reuse",),
        neighbours=0,
        max_new_tokens=3,
        out_dir=str(tmp_path / "out"),
        progress=False,
        plots=False,
    )
    answered: list[str] = []
    real_answer = fidelity.answer_once

    def spy(engine, method, question, chunks, budget, **kw):
        answered.append(method.name)
        return real_answer(engine, method, question, chunks, budget, **kw)

    monkeypatch.setattr(fidelity, "answer_once", spy)
    engine = tiny_engine(str(tmp_path / "kv"))
    try:
        first = run_fidelity(cfg, engine=engine)
        assert answered == ["full_recompute", "full_reuse"] * 2
        answered.clear()
        rows = run_fidelity(replace(cfg, methods=("full_reuse", "question@0.5/adaptive")), engine=engine)
        assert answered == ["question@0.5/adaptive"] * 2  # no second full prefill
        # A reference file cut short (a killed run) is answered again, not read.
        for path in (tmp_path / "out" / "references").iterdir():
            path.write_bytes(path.read_bytes()[:10])
        answered.clear()
        run_fidelity(replace(cfg, methods=("full_reuse", "question@0.3")), engine=engine)
        assert answered == ["full_recompute", "question@0.3"] * 2
    finally:
        engine.close()
    added = {r["qid"]: r for r in rows if r["method"] == "question@0.5/adaptive"}
    for r in first:
        assert (added[r["qid"]]["answer_full"], added[r["qid"]]["ttft_full_s"]) == (r["answer_full"], r["ttft_full_s"])
        assert added[r["qid"]]["tf_loglik_full"] == r["tf_loglik_full"]
    assert all(r["recompute_steps"][0] == 0.5 and r["machine"]["cores"] >= 1 for r in added.values())


def test_calibrate_saves_the_cheapest_ratio_that_agrees_and_from_pretrained_uses_it(tmp_path, monkeypatch):
    from cacheblend_bench.calibrate import calibrate, read_sample
    from cacheblend_bench.runner import tiny_engine
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.control.calibration import QualityProfile, choose_ratio, quality_profile_path
    from cacheblend_rag.testing import make_model, make_tokenizer

    engine = tiny_engine(str(tmp_path / "kv"))
    try:
        profile = calibrate(
            engine, [(SAMPLE_QUESTION, SAMPLE_CHUNKS)], "question", [0.0, 1.0], 0.99, max_new_tokens=6, progress=False
        )
    finally:
        engine.close()
    assert profile.curve["1"] == 1.0  # ratio 1 is exact, so it agrees
    assert profile.recompute_ratio == (0.0 if profile.curve["0"] >= 0.99 else 1.0) and profile.reached
    assert choose_ratio({0.1: 0.5, 0.3: 0.7}, 0.9) == (0.3, False)  # not reached: the best tried
    assert choose_ratio({0.1: 0.95, 0.3: 0.97}, 0.9) == (0.1, True)

    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path / "home"))
    model_dir = tmp_path / "model"
    make_model("llama").save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    plain = CacheBlendEngine.from_pretrained(str(model_dir), memory_bytes=0)
    from cacheblend_rag import BlendConfig

    assert plain.config == BlendConfig()
    QualityProfile("chunk", 0.25, 0.9, True, 1).save(quality_profile_path(plain.fingerprint))
    plain.close()
    tuned = CacheBlendEngine.from_pretrained(str(model_dir), memory_bytes=0)
    assert (tuned.config.strategy, tuned.config.recompute_ratio) == ("chunk", 0.25)
    tuned.close()

    bad = tmp_path / "sample.json"
    bad.write_text(json.dumps([{"question": "q"}]))
    with pytest.raises(ValueError, match="expected a JSON list of"):
        read_sample(str(bad))


def test_sign_test_and_paired_comparison_against_brute_force():
    from itertools import product

    from cacheblend_bench.fidelity import compare, pairwise, sign_test

    # Brute force: every +/- pattern of 9 untied questions, counting those at least as uneven as 7:2.
    extreme = sum(1 for signs in product((0, 1), repeat=9) if min(sum(signs), 9 - sum(signs)) <= 2)
    assert sign_test(7, 2) == pytest.approx(extreme / 2**9)
    assert sign_test(5, 5) == 1.0 and sign_test(0, 0) == 1.0

    def row(q, method, agree_f1, kl):
        return {"model": "m", "dataset": "d", "qid": q, "method": method, "agree_f1": agree_f1, "kl": kl, "tf_loglik": -kl}

    rows = [row(q, "a", 1.0, 0.1) for q in range(8)] + [row(q, "b", 0.5 if q < 6 else 1.0, 0.3) for q in range(8)]
    rows.append(row(99, "a", 0.0, 9.0))  # answered by one method only: not paired
    c = compare(rows, "a", "b")
    assert (c["n"], c["wins"], c["losses"], c["ties"]) == (8, 6, 0, 2)
    assert c["diff"] == pytest.approx(6 * 0.5 / 8) and c["sign_p"] == pytest.approx(2 / 2**6)
    k = compare(rows, "a", "b", "kl")  # lower KL is better: a wins every question
    assert (k["wins"], k["losses"], k["diff"]) == (8, 0, pytest.approx(-0.2))
    assert {(p["a"], p["b"], p["metric"]) for p in pairwise(rows)} == {("a", "b", m) for m in ("agree_f1", "kl", "tf_loglik")}


def _row(qid: str, method: str, ttft_full: float, ttft: float, dataset: str = "hotpotqa") -> dict:
    return {
        "model": "m",
        "dataset": dataset,
        "qid": qid,
        "method": method,
        "agree": True,
        "agree_f1": 1.0,
        "f1": 0.5,
        "f1_full": 0.5,
        "kl": 0.1,
        "tf_loglik": -0.5,
        "tf_loglik_full": -0.4,
        "ttft_full_s": ttft_full,
        "ttft_s": ttft,
        "recompute_fraction": 0.1,
        "answer_hint": "",
        "margin_full": 1.0,
    }


def test_report_only_summarises_the_rows_and_times_only_the_quiet_questions(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # q1 ran on a quiet machine (full 10 s, method 2 s: 5x); q2 shared it (full 30 s, method 3 s: 10x).
    rows = [_row("q1", "full_reuse", 10.0, 2.0), _row("q2", "full_reuse", 30.0, 3.0)]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = FidelityConfig(
        model="m",
        methods=("full_reuse",),
        out_dir=str(out),
        progress=False,
        plots=False,
        report_only=True,
        ttft_questions=("hotpotqa/q1",),
    )
    assert len(run_fidelity(cfg)) == 2  # no dataset, no model: the rows as they are
    saved = {e["dataset"]: e for e in json.loads((out / "summary.json").read_text())["summary"]}
    assert saved["all"]["n"] == 2 and saved["all"]["ttft_questions"] == 1
    assert saved["all"]["ttft_speedup"] == pytest.approx(5.0)
    every = {e["dataset"]: e for e in summarize(rows)}
    assert every["all"]["ttft_speedup"] == pytest.approx(40.0 / 5.0) and every["all"]["ttft_questions"] == 2
    with pytest.raises(ValueError, match="holds no results to report: run without --report-only first"):
        run_fidelity(replace(cfg, out_dir=str(tmp_path / "empty")))


def test_fidelity_cli_reads_the_quiet_question_list_and_refuses_a_bad_one(tmp_path, capsys):
    from cacheblend_rag.cli.app import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text(json.dumps(_row("q1", "full_reuse", 10.0, 2.0)) + "\n")
    good, bad = tmp_path / "quiet.json", tmp_path / "bad.json"
    good.write_text(json.dumps(["hotpotqa/q1"]))
    bad.write_text(json.dumps({"hotpotqa": ["q1"]}))
    args = ["fidelity", "--model", "m", "--methods", "full_reuse", "--out", str(out), "--report-only", "--no-plots", "--quiet"]
    assert main([*args, "--ttft-questions", str(good)]) == 0
    assert json.loads((out / "summary.json").read_text())["summary"][0]["ttft_questions"] == 1
    assert main([*args, "--ttft-questions", str(bad)]) == 2
    assert 'expected a JSON list of "dataset/qid" strings' in capsys.readouterr().err


def test_more_kv_formats_in_one_run_give_each_formats_own_run_and_compute_each_chunk_once(tmp_path, monkeypatch):
    from cacheblend_bench.runner import tiny_engine

    base = FidelityConfig(
        model="tiny",
        datasets=("hotpotqa",),
        n=2,
        methods=("full_reuse/nb", "question@0.3/nb"),
        neighbours=1,
        neighbour_pool="corpus",
        max_new_tokens=3,
        progress=False,
        plots=False,
    )
    alone = {}
    for fmt in ("float", "int8"):
        engine = tiny_engine(str(tmp_path / f"kv-alone-{fmt}"), kv_format=None if fmt == "float" else fmt)
        try:
            alone[fmt] = run_fidelity(replace(base, kv_format=fmt, out_dir=str(tmp_path / f"alone-{fmt}")), engine=engine)
        finally:
            engine.close()

    engine = tiny_engine(str(tmp_path / "kv-shared"))
    computed = []
    compute = engine.chunk_cache.compute
    monkeypatch.setattr(engine.chunk_cache, "compute", lambda *a, **k: computed.append(1) or compute(*a, **k))
    shared = replace(base, also_kv_formats=("int8",), out_dir=str(tmp_path / "shared"))
    try:
        rows = run_fidelity(shared, engine=engine)
    finally:
        engine.close()
    int8_rows = [json.loads(line) for line in (tmp_path / "shared" / "kv-int8" / "results.jsonl").read_text().splitlines()]
    # Two questions, six chunks at most each: a plain and a neighbour-aware cache per chunk, once.
    assert 0 < len(computed) <= 2 * 6 * 2
    for got, want in ((rows, alone["float"]), (int8_rows, alone["int8"])):
        assert [(r["qid"], r["method"], r["kv_format"]) for r in got] == [(r["qid"], r["method"], r["kv_format"]) for r in want]
        for g, w in zip(got, want):
            assert g["answer"] == w["answer"] and g["answer_full"] == w["answer_full"]
            assert g["kl"] == pytest.approx(w["kl"], rel=1e-4, abs=1e-7)
    assert any(a["kl"] != b["kl"] for a, b in zip(rows, int8_rows))  # the formats did differ
    assert json.loads((tmp_path / "shared" / "kv-int8" / "summary.json").read_text())["summary"]
    with pytest.raises(ValueError, match="repeats a format"):
        replace(base, also_kv_formats=("float",))
    with pytest.raises(ValueError, match="measured with kv_format='int8', not 'int4'"):
        run_fidelity(replace(shared, kv_format="int4", also_kv_formats=(), out_dir=str(tmp_path / "shared" / "kv-int8")))
