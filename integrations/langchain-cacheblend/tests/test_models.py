"""CacheBlendLLM / ChatCacheBlend against the engine called directly (tiny random model)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import RunnablePassthrough

from langchain_cacheblend import (
    CacheBlendLLM,
    CacheBlendRetriever,
    ChatCacheBlend,
    ChunkRegistry,
    RAGPromptValue,
    chunk_block,
    rag_message,
)

N = 6  # tokens to generate: enough to compare, cheap on the tiny model
TEMPLATE = "Answer the question using only this context.\n\nContext:\n{context}\n\nQuestion: {question}\nAnswer:"
QUESTION = "Who won two Nobel prizes?"


def format_docs(docs):
    return "\n\n".join(d.page_content for d in docs)


class Collect(BaseCallbackHandler):
    def __init__(self):
        self.tokens: list[str] = []
        self.infos: list[dict] = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)

    def on_llm_end(self, response, **kwargs):
        gen = response.generations[0][0]
        info = gen.generation_info or {}
        if not info.get("mode") and getattr(gen, "message", None) is not None:
            info = gen.message.response_metadata
        self.infos.append(info)


def texts(docs):
    return [d.page_content for d in docs]


# ---------------------------------------------------------------------- the unchanged chain
def test_unchanged_chain_hits_chunk_caches_and_matches_the_engine(deep_engine, vectorstore):
    tiny_engine = deep_engine
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N)
    inner = vectorstore.as_retriever(search_kwargs={"k": 2})
    retriever = CacheBlendRetriever(retriever=inner, llm=llm)
    prompt = PromptTemplate.from_template(TEMPLATE)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()

    cb = Collect()
    first = chain.invoke(QUESTION, config={"callbacks": [cb]})
    tiny_engine.flush()  # the misses' KV is written back in the background
    second = chain.invoke(QUESTION, config={"callbacks": [cb]})
    miss, hit = cb.infos

    docs = inner.invoke(QUESTION)
    # The template's text around the chunks becomes the engine's question turn.
    question = f"Answer the question using only this context.\n\nContext:\n\nQuestion: {QUESTION}\nAnswer:"
    ref = tiny_engine.generate(question, texts(docs), max_new_tokens=N)
    full = tiny_engine.generate(question, texts(docs), max_new_tokens=N, mode="full_recompute")

    assert hit["question"] == question
    assert (miss["chunk_hits"], miss["chunk_misses"]) == (0, 2)
    assert (hit["chunk_hits"], hit["chunk_misses"]) == (2, 0)
    assert full.stats["recompute_fraction"] == 1.0 and hit["recompute_fraction"] < 0.6
    # After the filtering layers only ~15% of the chunk tokens are recomputed (the instruction
    # and question tokens always are).
    always = hit["prompt_tokens"] - hit["context_tokens"]
    assert hit["recomputed_per_layer"][-1] - always <= 0.16 * hit["context_tokens"]
    assert first == second == ref.text
    assert hit["prompt_tokens"] == full.stats["prompt_tokens"]


def test_unchanged_chat_chain_matches_the_engine(tiny_engine, vectorstore):
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N)
    inner = vectorstore.as_retriever(search_kwargs={"k": 3})
    retriever = CacheBlendRetriever(retriever=inner, llm=chat, precompute="sync")
    prompt = ChatPromptTemplate.from_messages([("system", "Use this context:\n\n{context}"), ("human", "{question}")])
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | chat
    msg = chain.invoke(QUESTION)
    ref = tiny_engine.generate(f"Use this context:\n\n{QUESTION}", texts(inner.invoke(QUESTION)), max_new_tokens=N)
    assert msg.content == ref.text
    assert msg.response_metadata["chunk_hits"] == 3  # precompute="sync" cached them at retrieval
    assert msg.usage_metadata["input_tokens"] == ref.stats["prompt_tokens"]


# ---------------------------------------------------------------------- explicit chunks
def test_explicit_inputs_are_the_engine_call(tiny_engine, documents):
    docs = documents[:3]
    ref = tiny_engine.generate(QUESTION, texts(docs), max_new_tokens=N)
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    assert llm.invoke({"question": QUESTION, "context": docs}) == ref.text
    assert llm.invoke(RAGPromptValue(question=QUESTION, documents=docs)) == ref.text
    assert llm.invoke({"query": QUESTION, "documents": texts(docs)}) == ref.text
    assert chat.invoke({"question": QUESTION, "context": docs}).content == ref.text
    assert chat.invoke([rag_message(QUESTION, docs)]).content == ref.text
    # Flagged blocks are chunks wherever they are; system text joins the question turn.
    msgs = [SystemMessage("Be brief."), HumanMessage([chunk_block(d) for d in docs] + [{"type": "text", "text": QUESTION}])]
    ref2 = tiny_engine.generate(f"Be brief.\n\n{QUESTION}", texts(docs), max_new_tokens=N)
    out = chat.invoke(msgs)
    assert out.content == ref2.text and out.response_metadata["question"] == f"Be brief.\n\n{QUESTION}"


def test_chunk_block_carries_metadata(documents):
    block = chunk_block(documents[1])
    assert block["type"] == "text" and block["text"] == documents[1].page_content
    assert block["extras"] == {"cacheblend_chunk": True, "metadata": documents[1].metadata}


# ---------------------------------------------------------------------- streaming / async / batch
def test_streaming_reports_tokens_through_callbacks(tiny_engine, documents):
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N)
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N)
    x = {"question": QUESTION, "context": documents[:2]}
    ref = tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N)

    cb = Collect()
    pieces = list(llm.stream(x, config={"callbacks": [cb]}))
    assert "".join(pieces) == ref.text and "".join(cb.tokens) == ref.text and len(pieces) > 1

    cb = Collect()
    assert llm.invoke(x, config={"callbacks": [cb]}) == ref.text
    assert "".join(cb.tokens) == ref.text and len(cb.tokens) > 1

    cb = Collect()
    chunks = list(chat.stream(x, config={"callbacks": [cb]}))
    assert "".join(c.content for c in chunks) == ref.text == "".join(cb.tokens)
    assert chunks[-1].response_metadata["chunk_hits"] + chunks[-1].response_metadata["chunk_misses"] == 2


def test_async_and_batch(tiny_engine, documents):
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N)
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N)
    inputs = [
        {"question": QUESTION, "context": documents[:2]},
        {"question": "Where is the Eiffel Tower?", "context": documents[1:3]},
    ]
    refs = [tiny_engine.generate(x["question"], texts(x["context"]), max_new_tokens=N).text for x in inputs]

    assert llm.batch(inputs) == refs
    assert [m.content for m in chat.batch(inputs)] == refs

    async def run():
        cb = Collect()
        streamed = [c async for c in llm.astream(inputs[0], config={"callbacks": [cb]})]
        chat_streamed = [c.content async for c in chat.astream(inputs[1])]
        return (
            await llm.ainvoke(inputs[0]),
            (await chat.ainvoke(inputs[1])).content,
            "".join(streamed),
            "".join(cb.tokens),
            "".join(chat_streamed),
            await llm.abatch(inputs),
        )

    a, b, s, t, cs, ab = asyncio.run(run())
    assert (a, b, s, t, cs, ab) == (refs[0], refs[1], refs[0], refs[0], refs[1], refs)


def test_overlapping_calls_are_decoded_together_with_the_same_answers(tiny_engine, documents):
    # max_batch > 1: batch/abatch/concurrent calls share decode steps (cacheblend_rag.serving.Batcher).
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, max_batch=4)
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N, max_batch=4, registry=ChunkRegistry())
    questions = [QUESTION, "Where is the Eiffel Tower?", "Which river is it?", "Who painted it?"]
    inputs = [{"question": q, "context": documents[i : i + 2]} for i, q in enumerate(questions)]
    tiny_engine.precompute(texts(documents), progress=False)
    tiny_engine.flush()
    refs = [tiny_engine.generate(x["question"], texts(x["context"]), max_new_tokens=N).text for x in inputs]
    assert llm.batch(inputs) == refs
    assert asyncio.run(llm.abatch(inputs)) == refs
    assert llm.batcher.rows_stepped > llm.batcher.steps  # the answers really shared decode steps
    assert CacheBlendLLM(engine=tiny_engine).batcher is None
    answers = chat.batch(inputs)
    assert [m.content for m in answers] == refs
    for m, x in zip(answers, inputs):
        cached = sum(len(s) for s in tiny_engine.build_layout(x["question"], texts(x["context"])).segments if s.reusable)
        assert m.usage_metadata["input_token_details"]["cache_read"] == cached
    assert "".join(llm.stream(inputs[0])) == refs[0]
    assert llm.invoke("Hello, no documents here") == CacheBlendLLM(engine=tiny_engine, max_new_tokens=N).invoke(
        "Hello, no documents here"
    )


def test_stop_sequences_reach_the_engine(tiny_engine, documents):
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N)
    x = {"question": QUESTION, "context": documents[:2]}
    full = llm.invoke(x)
    stop = full[2:4]
    ref = tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N, stop=[stop])
    assert llm.invoke(x, stop=[stop]) == ref.text == full[: full.index(stop)]
    assert CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, stop=[stop]).invoke(x) == ref.text


# ---------------------------------------------------------------------- parameters and metadata
def test_generation_parameters_and_metadata(tiny_engine, documents):
    llm = CacheBlendLLM(engine=tiny_engine, max_tokens=N, mode="full_recompute")
    assert llm.max_new_tokens == N
    x = {"question": QUESTION, "context": documents[:2]}
    res = llm.generate_prompt([llm._convert_input(x)])
    info = res.generations[0][0].generation_info
    assert info["mode"] == "full_recompute" and info["recompute_fraction"] == 1.0
    assert {"ttft_s", "chunk_hits", "chunk_misses", "prompt_tokens", "finish_reason"} <= set(info)
    # Per-call overrides (also what .bind(...) passes).
    blended = llm.bind(mode="cacheblend", recompute_ratio=0.0).invoke(x)
    ref = tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N, recompute_ratio=0.0)
    assert blended == ref.text
    with pytest.raises(TypeError, match="unknown generation arguments"):
        llm.invoke(x, bogus=1)
    params = llm._identifying_params
    assert params["mode"] == "full_recompute" and params["max_new_tokens"] == N
    assert llm._llm_type == "cacheblend" and ChatCacheBlend(engine=tiny_engine)._llm_type == "cacheblend-chat"


def test_llm_cache_keys_on_seed_and_stop(tiny_engine, documents):
    """LangChain's LLM cache keys on the identifying parameters: an answer cached under one seed or
    default stop list must not be served for another."""
    from langchain_core.caches import InMemoryCache

    x = {"question": QUESTION, "context": documents[:2]}
    sampled = dict(engine=tiny_engine, max_new_tokens=N, temperature=1.0, cache=InMemoryCache())
    refs = [tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N, temperature=1.0, seed=s).text for s in (1, 2)]
    assert refs[0] != refs[1]
    assert [CacheBlendLLM(seed=s, **sampled).invoke(x) for s in (1, 2, 1)] == [refs[0], refs[1], refs[0]]
    stop = refs[0][2:4]
    assert CacheBlendLLM(seed=1, stop=[stop], **sampled).invoke(x) == refs[0][: refs[0].index(stop)]


def test_llm_cache_keys_on_the_engines_settings(tiny_engine, tmp_path, documents):
    """Two LLMs whose engines differ only in what they were loaded with (the answer hint, the
    blend config) may share one LangChain cache and still get their own answers."""
    import json

    from langchain_core.caches import InMemoryCache

    from cacheblend_rag import BlendConfig, CacheBlendEngine
    from cacheblend_rag.store.disk import KVStore

    def engine(name: str, **kwargs) -> CacheBlendEngine:
        return CacheBlendEngine(
            tiny_engine.model, tiny_engine.tokenizer, store=KVStore(tmp_path / name), pipelined=False, **kwargs
        )

    engines = [
        tiny_engine,
        engine("hint", answer_hint="Reply with a year only, please."),
        engine("ratio", config=BlendConfig(recompute_ratio=1.0)),
    ]
    x = {"question": QUESTION, "context": documents[:2]}
    refs = [e.generate(QUESTION, texts(documents[:2]), max_new_tokens=N).text for e in engines]
    assert len(set(refs)) == 3
    cache = InMemoryCache()
    assert [CacheBlendLLM(engine=e, max_new_tokens=N, cache=cache).invoke(x) for e in [*engines, engines[0]]] == [*refs, refs[0]]
    # The key is plain data, equal for an engine built the same way (as in another process).
    same = engine("same")
    assert json.dumps(same.answer_settings()) == json.dumps(tiny_engine.answer_settings())
    for e in engines[1:] + [same]:
        e.close()


def test_token_ids_use_the_models_tokenizer(tiny_engine):
    llm = CacheBlendLLM(engine=tiny_engine)
    text = "The Eiffel Tower is in Paris."
    ids = tiny_engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert llm.get_token_ids(text) == ids and llm.get_num_tokens(text) == len(ids)


def test_default_engine_loads_lazily_once(tiny_engine, monkeypatch):
    from cacheblend_rag import CacheBlendEngine

    calls = []
    monkeypatch.setattr(
        CacheBlendEngine, "from_pretrained", classmethod(lambda cls, model=None, **kw: calls.append((model, kw)) or tiny_engine)
    )
    llm = ChatCacheBlend(model="my-model", engine_kwargs={"device": "cpu"}, max_new_tokens=2)
    assert calls == []
    llm.invoke({"question": QUESTION, "context": ["The Eiffel Tower is in Paris."]})
    llm.invoke({"question": QUESTION, "context": ["The Eiffel Tower is in Paris."]})
    assert calls == [("my-model", {"device": "cpu"})]


# ---------------------------------------------------------------------- no chunks / bad input
def test_prompt_without_known_chunks_is_a_plain_full_prefill(tiny_engine):
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    cb = Collect()
    out = llm.invoke("Where is the Eiffel Tower?", config={"callbacks": [cb]})
    tok = tiny_engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Where is the Eiffel Tower?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        gen = tiny_engine.model.generate(
            ids, max_new_tokens=N, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
    assert out == tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    assert cb.infos[0]["mode"] == "plain_chat" and cb.infos[0]["chunk_hits"] == 0

    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    reply = chat.invoke([SystemMessage("Be brief."), HumanMessage("Hi"), AIMessage("Hello"), HumanMessage("Where?")])
    assert reply.response_metadata["mode"] == "plain_chat"


def test_bad_inputs_raise_clear_errors(tiny_engine, documents):
    strict = CacheBlendLLM(engine=tiny_engine, require_chunks=True, registry=ChunkRegistry())
    with pytest.raises(
        ValueError, match="no chunks found in the prompt; wrap your retriever|no chunks found in the prompt: wrap your retriever"
    ):
        strict.invoke("What is the capital of France?")
    with pytest.raises(ValueError, match="no chunks found"):
        ChatCacheBlend(engine=tiny_engine, require_chunks=True, registry=ChunkRegistry()).invoke("Hi")

    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N)
    huge = "The river Thames flows through London and Oxford. " * 200
    with pytest.raises(ValueError, match="context window"):
        llm.invoke({"question": QUESTION, "context": [huge]})
    with pytest.raises(ValueError, match="context window"):
        list(ChatCacheBlend(engine=tiny_engine).stream({"question": QUESTION, "context": [huge]}))
    with pytest.raises(TypeError, match="list of Documents or strings"):
        llm.invoke({"question": QUESTION, "context": format_docs(documents)})
    with pytest.raises(ValueError, match="needs a 'question'"):
        llm.invoke({"context": documents})
    reg = ChunkRegistry([documents[0].page_content])
    with pytest.raises(ValueError, match="no question text"):
        CacheBlendLLM(engine=tiny_engine, registry=reg).invoke("\n" + documents[0].page_content + "\n")
    with pytest.raises(ValueError, match="not supported"):
        ChatCacheBlend(engine=tiny_engine).invoke([HumanMessage([{"type": "image", "url": "http://x/y.png"}])])


# ---------------------------------------------------------------------- usage, matching reports
def test_usage_metadata_reports_the_chunk_tokens_read_from_the_cache(tiny_engine, documents):
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    docs = documents[:3]
    layout = tiny_engine.build_layout(QUESTION, texts(docs))
    chunk_tokens = [len(s) for s in layout.segments if s.reusable]
    assert len(chunk_tokens) == 3

    tiny_engine.precompute([docs[1].page_content], progress=False)  # one of the three is cached
    tiny_engine.flush()
    first = chat.invoke([rag_message(QUESTION, docs)])
    assert (first.response_metadata["chunk_hits"], first.response_metadata["chunk_misses"]) == (1, 2)
    assert first.usage_metadata["input_token_details"] == {"cache_read": chunk_tokens[1]}
    assert first.usage_metadata["input_tokens"] == len(layout)

    second = chat.invoke([rag_message(QUESTION, docs)])  # the misses were written back
    assert (
        second.usage_metadata["input_token_details"]["cache_read"]
        == sum(chunk_tokens)
        == second.response_metadata["context_tokens"]
    )
    streamed = None
    for piece in chat.stream([rag_message(QUESTION, docs)]):
        streamed = piece if streamed is None else streamed + piece
    assert streamed.usage_metadata["input_token_details"]["cache_read"] == sum(chunk_tokens)
    # A full prefill reads nothing from the cache, nor does a plain chat.
    full = chat.invoke([rag_message(QUESTION, docs)], mode="full_recompute")
    assert full.usage_metadata["input_token_details"]["cache_read"] == 0
    assert chat.invoke("Hello").usage_metadata["input_token_details"]["cache_read"] == 0


def test_metadata_reports_what_matching_found_and_warns_once_when_nothing_matched(tiny_engine, documents):
    reg = ChunkRegistry(texts(documents))
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, registry=reg)
    cb = Collect()
    prompt = TEMPLATE.format(context=format_docs(documents[:2]), question=QUESTION)
    llm.invoke(prompt, config={"callbacks": [cb]})
    assert cb.infos[-1]["chunk_source"] == "matched" and cb.infos[-1]["chunks_matched"] == 2

    # A format_docs that numbers the documents inside their text hides every chunk.
    numbered = "\n".join(f"[{i}] {d.page_content[:60]}" for i, d in enumerate(documents[:2]))
    with pytest.warns(
        UserWarning, match=r"the prompt contains none of the 4 registered chunk texts, so it is answered with a full prefill"
    ):
        llm.invoke(TEMPLATE.format(context=numbered, question=QUESTION), config={"callbacks": [cb]})
    assert cb.infos[-1]["chunks_matched"] == 0 and cb.infos[-1]["mode"] == "plain_chat"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second miss on the same model does not warn again
        llm.invoke(TEMPLATE.format(context=numbered, question="And the second?"))
    # Explicit chunks are reported as such; an empty registry never warns.
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    out = chat.invoke([rag_message(QUESTION, documents[:2])])
    assert (out.response_metadata["chunk_source"], out.response_metadata["chunks_matched"]) == ("explicit", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chat.invoke("Hello").response_metadata["chunk_source"] == "none"


def test_match_chunks_false_answers_the_users_own_prompt(tiny_engine, documents):
    """The switch for the implicit rewrite: the prompt is answered exactly as the template wrote it."""
    reg = ChunkRegistry(texts(documents))
    prompt = TEMPLATE.format(context=format_docs(documents[:2]), question=QUESTION)
    kept = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, registry=reg, match_chunks=False)
    plain = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    cb = Collect()
    assert kept.invoke(prompt, config={"callbacks": [cb]}) == plain.invoke(prompt)
    assert cb.infos[0]["mode"] == "plain_chat" and cb.infos[0]["question"] == prompt
    rewritten = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, registry=reg)
    rewritten.invoke(prompt, config={"callbacks": [cb]})
    assert cb.infos[1]["mode"] == "cacheblend" and cb.infos[1]["question"] != prompt


# ---------------------------------------------------------------------- review: contracts
def test_llm_explicit_inputs_keep_their_chunks_with_match_chunks_false(tiny_engine, documents):
    """match_chunks=False turns off finding chunks in plain prompts; explicit documents (a dict, a
    RAGPromptValue) are still the engine's chunks, as they are for the chat model."""
    docs = documents[:2]
    ref = tiny_engine.generate(QUESTION, texts(docs), max_new_tokens=N)
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, match_chunks=False, registry=ChunkRegistry())
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N, match_chunks=False, registry=ChunkRegistry())
    cb = Collect()
    assert llm.invoke({"question": QUESTION, "context": docs}, config={"callbacks": [cb]}) == ref.text
    assert "".join(llm.stream(RAGPromptValue(question=QUESTION, documents=docs))) == ref.text
    assert chat.invoke({"question": QUESTION, "context": docs}).content == ref.text
    assert cb.infos[0]["mode"] == "cacheblend" and cb.infos[0]["chunk_source"] == "explicit"
    assert cb.infos[0]["question"] == QUESTION


def test_llm_cache_keys_on_per_call_settings(tiny_engine, documents):
    """BaseLLM's cache key leaves out the call's keyword arguments: invoke(x, seed=2) or
    .bind(seed=2) must not be served the answer cached for seed 1."""
    from langchain_core.caches import InMemoryCache

    x = {"question": QUESTION, "context": documents[:2]}
    refs = [tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N, temperature=1.0, seed=s).text for s in (1, 2)]
    assert refs[0] != refs[1]
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, temperature=1.0, cache=InMemoryCache())
    assert llm.invoke(x, seed=1) == refs[0]
    assert llm.invoke(x, seed=2) == refs[1]
    assert llm.bind(seed=2).invoke(x) == refs[1]
    assert asyncio.run(llm.ainvoke(x, seed=1)) == refs[0]
    full = tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N, mode="full_recompute", temperature=1.0, seed=1)
    assert llm.invoke(x, seed=1, mode="full_recompute") == full.text


def test_models_on_one_engine_share_one_batcher(tiny_engine, documents):
    """A model made per request (max_batch > 1) must not leave a batcher thread behind each time."""
    import threading

    def batcher_threads():
        return sum(t.name == "cacheblend-batcher" for t in threading.enumerate())

    before = batcher_threads()
    x = {"question": QUESTION, "context": documents[:2]}
    answers = {ChatCacheBlend(engine=tiny_engine, max_new_tokens=N, max_batch=2).invoke(x).content for _ in range(3)}
    answers |= {CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, max_batch=2).invoke(x) for _ in range(3)}
    assert answers == {tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N).text}
    assert batcher_threads() - before <= 1


@pytest.mark.parametrize("model_class", [CacheBlendLLM, ChatCacheBlend])
def test_cancelled_ainvoke_stops_generating(tiny_engine, documents, model_class):
    """asyncio.wait_for(model.ainvoke(...), timeout) or a cancelled task must free the engine, not
    keep decoding to max_new_tokens behind the caller's back."""

    class Count(BaseCallbackHandler):
        n = 0

        def on_llm_new_token(self, token, **kwargs):
            Count.n += 1

    model = model_class(engine=tiny_engine, max_new_tokens=200)

    async def run():
        task = asyncio.create_task(
            model.ainvoke({"question": QUESTION, "context": documents[:2]}, config={"callbacks": [Count()]})
        )
        while Count.n < 2:
            assert not task.done()
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        at_cancel = Count.n
        lock = tiny_engine.lock
        await asyncio.to_thread(lambda: (lock.acquire(), lock.release()))  # the run has let go
        return at_cancel, Count.n

    at_cancel, total = asyncio.run(run())
    assert total - at_cancel <= 3


def test_chat_accepts_langchains_stream_flag(tiny_engine, documents):
    """BaseChatModel reads invoke(..., stream=True/False) to choose _stream or _generate and passes
    it on; it is not a generation setting to refuse."""
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N)
    x = {"question": QUESTION, "context": documents[:2]}
    ref = tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N).text
    assert chat.invoke(x, stream=True).content == ref
    assert chat.invoke(x, stream=False).content == ref
    with pytest.raises(TypeError, match="unknown generation arguments"):
        chat.invoke(x, bogus=1)


def test_blank_documents_are_left_out_by_both_models(tiny_engine, documents):
    """An empty page among the retrieved documents is no chunk for either model (the engine
    refuses empty chunks); the answer is the one over the other documents."""
    from langchain_core.documents import Document

    docs = [documents[0], Document(page_content="  \n"), documents[1]]
    ref = tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N)
    chat = ChatCacheBlend(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    llm = CacheBlendLLM(engine=tiny_engine, max_new_tokens=N, registry=ChunkRegistry())
    assert chat.invoke({"question": QUESTION, "context": docs}).content == ref.text
    assert llm.invoke({"question": QUESTION, "context": docs}) == ref.text


def test_the_fidelity_guard_comes_with_the_engines_config(tiny_engine, documents):
    from dataclasses import replace

    x = {"question": QUESTION, "context": documents[:2]}
    full = tiny_engine.generate(QUESTION, texts(documents[:2]), max_new_tokens=N, mode="full_recompute_saved")
    tiny_engine.config = replace(tiny_engine.config, guard_margin=float("inf"))  # always below: always escalated
    llm = CacheBlendLLM(engine=tiny_engine, max_tokens=N)
    res = llm.generate_prompt([llm._convert_input(x)])
    info = res.generations[0][0].generation_info
    assert info["escalated"] is True and info["first_token_margin"] >= 0
    assert res.generations[0][0].text == full.text
