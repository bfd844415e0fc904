"""One default everywhere: with the chunk caches `ask` and the integrations' helpers make
(neighbour-aware ones) in the store, every entry point, in its default settings, answers the same
question over the same chunks with the same tokens as the engine's own ``generate``, and the
neighbour-aware caches are what they read (a plain-cache answer differs)."""

from __future__ import annotations

import warnings

import pytest
import torch

from cacheblend_rag import BlendConfig
from cacheblend_rag.testing import make_engine

CHUNKS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "The river Thames flows through London and Oxford.",
    "Alice was born in 1980 and Bob is thirteen years older than Alice.",
]
QUESTIONS = ["How many years older is Bob than Alice?", "Which river flows through Oxford?"]
N = 10


@pytest.fixture
def engine(tmp_path):
    eng = make_engine("llama", seed=0, store_dir=tmp_path / "kv")
    eng.precompute(CHUNKS, neighbours=2, progress=False)  # as ask and the precompute helpers do
    eng.flush()
    yield eng
    eng.close()


def test_every_entry_point_answers_as_the_engine_does_by_default(engine):
    from fastapi.testclient import TestClient
    from langchain_core.documents import Document
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    from cacheblend_rag.chat.matching import ChunkRegistry
    from cacheblend_rag.server import ServerConfig, create_app
    from langchain_cacheblend import CacheBlendLLM, ChatCacheBlend, rag_message
    from llama_index.cacheblend import CacheBlendLLM as IndexLLM
    from llama_index.cacheblend import CacheBlendQueryEngine

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(text=c, id_=f"n{i}"), score=1.0) for i, c in enumerate(CHUNKS)]

    want = {q: engine.generate(q, CHUNKS, max_new_tokens=N) for q in QUESTIONS}
    assert all(w.stats["neighbour_hits"] == len(CHUNKS) - 1 for w in want.values())  # every non-first chunk
    # The neighbour-aware caches change the prefill, so agreeing below means reading them.
    layout = engine.build_layout(QUESTIONS[0], CHUNKS)
    with_nb = engine.prefill(layout, "cacheblend").logits
    without = engine.prefill(layout, "cacheblend", BlendConfig(neighbour_caches=False)).logits
    assert not torch.equal(with_nb, without)

    llm = CacheBlendLLM(engine=engine, max_new_tokens=N, registry=ChunkRegistry())
    chat = ChatCacheBlend(engine=engine, max_new_tokens=N, registry=ChunkRegistry())
    index_llm = IndexLLM(engine=engine, max_new_tokens=N)
    query_engine = CacheBlendQueryEngine.from_args(Fixed(), llm=index_llm)
    got: dict[str, dict[str, str]] = {q: {} for q in QUESTIONS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TestClient(create_app(engine, ServerConfig(model_name="m"))) as http:  # the server's defaults
            for q in QUESTIONS:
                got[q]["langchain llm"] = llm.invoke({"question": q, "context": [Document(page_content=c) for c in CHUNKS]})
                got[q]["langchain chat"] = chat.invoke([rag_message(q, CHUNKS)]).content
                got[q]["llama_index query engine"] = query_engine.query(q).response
                r = http.post(
                    "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": q}], "documents": CHUNKS, "max_tokens": N},
                )
                assert r.status_code == 200, r.text
                got[q]["server"] = r.json()["choices"][0]["message"]["content"]
    for q in QUESTIONS:
        for front, text in got[q].items():
            assert text == want[q].text, f"{front} answered {text!r} to {q!r}; the engine answered {want[q].text!r}"
