"""Shared fixtures: tiny random RoPE models with an offline tokenizer, built in milliseconds.

The benchmark tests read MuSiQue from ``$CACHEBLEND_RAG_MUSIQUE``; when it is unset, the data
folder beside the checkout (``../shared/data/musique_dev.json``, where CI keeps its copy) is used,
so a plain ``pytest`` finds the same data as ``.ci/run``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_MUSIQUE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("CACHEBLEND_RAG_MUSIQUE") and SHARED_MUSIQUE.is_file():
        os.environ["CACHEBLEND_RAG_MUSIQUE"] = str(SHARED_MUSIQUE)


from cacheblend_rag.testing import make_model, make_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(params=["llama", "qwen2"])
def engine(request, tokenizer, tmp_path):
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.store.disk import KVStore

    model = make_model(request.param)
    eng = CacheBlendEngine(model, tokenizer, store=KVStore(tmp_path / "kv"), pipelined=False)
    yield eng
    eng.close()
