"""LangChain baselines: MapReduce and MapRerank QA chains over the same model and chunks.

The chains come from ``langchain_classic.chains.question_answering.load_qa_chain``. They send
whole prompt strings to an LLM; they run on the project's own LangChain model,
``langchain_cacheblend.CacheBlendLLM``, over the same engine (:func:`make_llm`). It gets a private,
empty chunk registry, so no prompt ever matches a chunk: every prompt is answered as a "plain
chat", i.e. the prompt goes into the model's chat template as the user turn, is prefilled in full
(no KV reuse: these chains have no chunk-cache notion) and decoded greedily by the engine's own
decoder. A callback handler (:class:`CallRecorder`) collects each call's engine stats, from which
:func:`run_chain` derives the chain's time to first token of its final answer.

MapRerank: LangChain's default prompt asks for "Helpful Answer: ...\\nScore: N" and its
``RegexParser`` raises ``ValueError`` on any reply without that exact shape, which small models
rarely produce (one bad reply crashes the whole chain). We give it a shorter prompt with the same
answer/score contract and :class:`TolerantRerankParser`, which accepts any reply: the answer is the
text before "Score", the score the first number after it, and a reply without a score ranks 0 (ties
keep retrieval order, so the best-retrieved chunk's answer wins when nothing is scored).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from langchain_classic.output_parsers.regex import RegexParser
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.prompts import PromptTemplate

INSTALL_HINT = "pip install -e integrations/langchain-cacheblend"


def cacheblend_llm_class():
    """``langchain_cacheblend.CacheBlendLLM``, imported only when a chain runs (see INSTALL_HINT)."""
    try:
        from langchain_cacheblend import CacheBlendLLM
    except ImportError as e:
        raise ImportError(
            f"the map_reduce and map_rerank baselines run on langchain_cacheblend.CacheBlendLLM, which "
            f"could not be imported ({e}): {INSTALL_HINT}"
        ) from e
    return CacheBlendLLM


def make_llm(engine, max_new_tokens: int = 64):
    """The chains' LLM: ``CacheBlendLLM`` over ``engine``, answering every prompt as a plain chat.

    Its own empty chunk registry (not the engine's shared one) means no prompt is ever split into
    chunks, so each call is a full prefill of the whole prompt; greedy decoding (temperature 0);
    ``cache=False`` so a globally set LangChain LLM cache can never answer a timed call.
    ``get_num_tokens`` counts with the model's own tokenizer (CacheBlendLLM's ``get_token_ids``).
    """
    from cacheblend_rag.chat.matching import ChunkRegistry

    return cacheblend_llm_class()(
        engine=engine,
        registry=ChunkRegistry(),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        cache=False,
    )


@dataclass
class CallLog:
    prompt: str
    reported_at: float  # perf_counter when LangChain reported the call's end (on_llm_end)
    ttft_s: float  # engine stats of the call, measured from the start of its prefill
    total_s: float
    prompt_tokens: int
    mode: str


class CallRecorder(BaseCallbackHandler):
    """Collects every LLM call of one chain run: its prompt and CacheBlendLLM's engine stats."""

    raise_error = True

    def __init__(self) -> None:
        self.calls: list[CallLog] = []
        self._prompts: dict[UUID, str] = {}

    def on_llm_start(self, serialized: dict[str, Any], prompts: list[str], *, run_id: UUID, **kwargs: Any) -> None:
        self._prompts[run_id] = prompts[0]  # LangChain starts one run per prompt

    def on_llm_end(self, response, *, run_id: UUID, **kwargs: Any) -> None:
        now = time.perf_counter()
        info = response.generations[0][0].generation_info or {}
        self.calls.append(
            CallLog(
                self._prompts.pop(run_id, ""),
                now,
                float(info.get("ttft_s", 0.0)),
                float(info.get("total_s", 0.0)),
                int(info.get("prompt_tokens", 0)),
                str(info.get("mode")),
            )
        )


class TolerantRerankParser(RegexParser):
    """Parse "answer ... Score: N" leniently; never raises (see the module docstring).

    A ``RegexParser`` subclass because ``MapRerankDocumentsChain`` accepts only those.
    """

    regex: str = r"(?is)(.*?)score\D*(\d{1,3})"
    output_keys: list[str] = ["answer", "score"]

    @property
    def _type(self) -> str:
        return "tolerant_rerank_parser"

    def parse(self, text: str) -> dict[str, str]:
        m = re.search(r"score", text, re.I)
        head, tail = (text[: m.start()], text[m.end() :]) if m else (text, "")
        num = re.search(r"\d{1,3}", tail)
        score = min(100, int(num.group())) if num else 0
        answer = re.sub(r"^\s*(helpful\s+)?answer\s*:\s*", "", head.strip(), flags=re.I).strip()
        return {"answer": answer.splitlines()[0].strip() if answer else "", "score": str(score)}


RERANK_TEMPLATE = """Use the context to answer the question. Reply with a short answer, then on a new line a score from 0 to 100 saying how well the context answers the question (0 if it does not).

Example:
Context: Apples are red.
Question: What color are apples?
Answer: red
Score: 100

Context:
---------
{context}
---------
Question: {question}
Answer:"""


def rerank_prompt() -> PromptTemplate:
    return PromptTemplate(template=RERANK_TEMPLATE, input_variables=["context", "question"], output_parser=TolerantRerankParser())


def make_chain(kind: str, llm, token_max: int = 3000):
    """``token_max``: MapReduce collapses mapped replies above this many tokens (LangChain's
    default 3000; the tiny test model's byte-level tokenizer needs more for the few-shot prompt)."""
    from langchain_classic.chains.question_answering import load_qa_chain

    if kind == "map_reduce":
        # LangChain's default map and combine prompts, as the paper's baseline used.
        return load_qa_chain(llm, chain_type="map_reduce", token_max=token_max)
    if kind == "map_rerank":
        return load_qa_chain(llm, chain_type="map_rerank", prompt=rerank_prompt())
    raise ValueError(f"unknown chain {kind!r}: choose map_reduce or map_rerank")


@dataclass
class ChainResult:
    text: str
    ttft_s: float
    total_s: float
    calls: int
    prompt_tokens: int
    log: list[CallLog]


def run_chain(chain, kind: str, question: str, chunks: list[str]) -> ChainResult:
    """Run the chain once; TTFT = time until the final answer's first token.

    MapReduce: the combine call's first token (all map calls included). MapRerank: the answer is
    picked from the map replies by score, so it exists only when the last map call ends.

    The combine call's first-token instant is its ``on_llm_end`` time minus the part of the call
    after the first token (engine stats ``total_s - ttft_s``; both are measured from the start of
    its prefill). It is the last call and a single-prompt ``generate``, so its ``on_llm_end``
    follows the end of its decode directly (map calls are batched: their ends are reported together
    after the batch, which is why only the last call's instant is used). The only error is the few
    microseconds between the engine's end of decode and the callback, and it adds to the TTFT.
    """
    from langchain_core.documents import Document

    recorder = CallRecorder()
    t0 = time.perf_counter()
    out = chain.invoke(
        {"input_documents": [Document(page_content=c) for c in chunks], "question": question},
        config={"callbacks": [recorder]},
    )
    end = time.perf_counter()
    calls = list(recorder.calls)
    odd = sorted({c.mode for c in calls} - {"plain_chat"})
    if odd:
        raise RuntimeError(f"{kind}: LLM calls answered in mode(s) {odd}, expected plain_chat (full prefill)")
    if kind == "map_reduce" and calls:
        last = calls[-1]
        ttft = (last.reported_at - (last.total_s - last.ttft_s)) - t0
    else:
        ttft = end - t0
    return ChainResult(str(out["output_text"]).strip(), ttft, end - t0, len(calls), sum(c.prompt_tokens for c in calls), calls)
