"""Prompts without chunks: a full prefill of the text as written, through the engine's own path.

Both framework integrations answer a prompt in which they find no chunk this way, so the answer
is what the unmodified model gives: the text (a chat rendered with the model's chat template) is
one non-reusable segment, prefilled by the engine's ``full_recompute`` mode and decoded as usual.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

from .config import SamplingParams
from .engine import CacheBlendEngine, GenerationStream
from .prompt import PromptLayout, Segment


def chat_text(tokenizer, messages: Sequence[Mapping[str, str]]) -> str:
    """``messages`` (role/content dicts) rendered with the tokenizer's chat template, ready for
    the assistant's turn. Templates without a system role get the system text folded into the
    next user turn; a tokenizer without a template gets the contents joined by blank lines."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        return "\n\n".join(m["content"] for m in msgs) + "\n"
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that rejects the system role
        return tokenizer.apply_chat_template(_fold_system(msgs), tokenize=False, add_generation_prompt=True)


def _fold_system(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    pending: list[str] = []
    for m in msgs:
        if m["role"] == "system":
            pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m = {"role": "user", "content": "\n\n".join(pending + [m["content"]])}
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def sampling_params(engine_kwargs: Mapping[str, object]) -> SamplingParams:
    """The decoding settings among ``engine.stream``'s keyword arguments (a plain prompt has no
    mode or ratio). ``stop`` goes in as given: one str is one stop sequence (SamplingParams)."""
    kw = engine_kwargs
    return SamplingParams(kw["max_new_tokens"], kw["temperature"], kw["top_p"], kw["top_k"], kw.get("stop") or (), kw.get("seed"))


def plain_stream(engine: CacheBlendEngine, text: str, params: SamplingParams) -> GenerationStream:
    """Stream the answer to ``text`` (already in the model's prompt format) with a full prefill.

    The stream's stats are the engine's ``full_recompute`` stats with no chunks.
    """
    t0 = time.perf_counter()
    if not text.strip():
        raise ValueError("the prompt is empty: nothing to answer")
    ids = tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) + params.max_new_tokens > engine.context_window:
        raise ValueError(
            f"the prompt is {len(ids)} tokens plus {params.max_new_tokens} to generate, more than the "
            f"model's context window of {engine.context_window} tokens: shorten the prompt or lower "
            "max_new_tokens"
        )
    layout = PromptLayout((Segment(text, ids, reusable=False),))
    return GenerationStream(engine, layout, "full_recompute", engine.config, params, t0)
