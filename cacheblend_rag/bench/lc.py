"""LangChain baselines: MapReduce and MapRerank QA chains over the same model and chunks.

The chains come from ``langchain_classic.chains.question_answering.load_qa_chain``. They send
whole prompt strings to an LLM, so they run on :class:`EngineLLM`, a plain LangChain ``LLM`` over
the engine's model: the prompt goes into the model's chat template as the user turn, is prefilled
in full (no KV reuse: these chains have no chunk-cache notion) and decoded greedily with the
engine's own decoder. The LLM logs each call's start, first-token and end times, from which the
runner derives the chain's time to first token of its final answer.

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

import torch
from langchain_core.language_models.llms import LLM
from langchain_core.prompts import PromptTemplate
from langchain_classic.output_parsers.regex import RegexParser
from pydantic import ConfigDict, Field

from ..config import SamplingParams
from ..generation import decode  # the engine's own decoder, so greedy decoding is identical


@dataclass
class CallLog:
    start: float
    first_token: float
    end: float
    prompt_tokens: int
    truncated: bool


class EngineLLM(LLM):
    """A LangChain LLM over a ``CacheBlendEngine``'s model and tokenizer (greedy by default)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any
    max_new_tokens: int = 64
    calls: list = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "cacheblend-engine"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_id": self.engine.model_id, "max_new_tokens": self.max_new_tokens}

    def _prompt_ids(self, prompt: str) -> tuple[list[int], bool]:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        else:
            text = prompt
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        room = self.engine.context_window - self.max_new_tokens
        if len(ids) > room:
            # Keep the end (the question and the answer cue); only tiny test models get here.
            return ids[-room:], True
        return ids, False

    def _call(self, prompt: str, stop: list[str] | None = None, run_manager=None, **kwargs: Any) -> str:
        start = time.perf_counter()
        model = self.engine.model
        ids, truncated = self._prompt_ids(prompt)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids], device=self.engine.device), use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None)
        cache = cache if cache is not None else out.past_key_values
        first = [0.0]

        def mark() -> None:
            first[0] = time.perf_counter()

        params = SamplingParams(max_new_tokens=int(kwargs.get("max_new_tokens", self.max_new_tokens)), stop=tuple(stop or ()))
        gen = decode(model, self.engine.tokenizer, cache, out.logits[0, -1].float(), len(ids), params, mark)
        parts = []
        while True:
            try:
                parts.append(next(gen))
            except StopIteration as done:
                text = done.value.text
                break
        self.calls.append(CallLog(start, first[0], time.perf_counter(), len(ids), truncated))
        return text

    def get_num_tokens(self, text: str) -> int:
        # The base class would load GPT-2's tokenizer from the hub; count with the model's own.
        return len(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])


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


def make_chain(kind: str, llm: LLM, token_max: int = 3000):
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
    truncated_calls: int


def run_chain(chain, llm: EngineLLM, kind: str, question: str, chunks: list[str]) -> ChainResult:
    """Run the chain once; TTFT = time until the final answer's first token.

    MapReduce: the combine call's first token (all map calls included). MapRerank: the answer is
    picked from the map replies by score, so it exists only when the last map call ends.
    """
    from langchain_core.documents import Document

    llm.calls.clear()
    t0 = time.perf_counter()
    out = chain.invoke({"input_documents": [Document(page_content=c) for c in chunks], "question": question})
    end = time.perf_counter()
    calls = list(llm.calls)
    ttft = (calls[-1].first_token - t0) if kind == "map_reduce" and calls else end - t0
    return ChainResult(
        str(out["output_text"]).strip(), ttft, end - t0, len(calls),
        sum(c.prompt_tokens for c in calls), sum(c.truncated for c in calls),
    )
