"""Shared fixtures: tiny random RoPE models with an offline tokenizer, built in milliseconds."""

from __future__ import annotations

import pytest

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
