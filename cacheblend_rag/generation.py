"""Decoding from a prefilled cache: greedy or sampled, streaming text deltas, stop strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .backbone import cache_kwarg
from .config import SamplingParams


@dataclass
class DecodeState:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    return ids


def _warpers(params: SamplingParams) -> LogitsProcessorList:
    procs = LogitsProcessorList()
    if params.temperature > 0:
        procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
    return procs


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could still grow into a stop string."""
    hold = 1 if text.endswith("\ufffd") else 0  # an incomplete UTF-8 sequence
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


def decode(
    model,
    tokenizer,
    cache,
    first_logits: torch.Tensor,
    start_position: int,
    params: SamplingParams,
    on_first_token: Callable[[], None] | None = None,
    model_kwargs: dict | None = None,
) -> Iterator[str]:
    """Yield text deltas; the generator's return value is the final ``DecodeState``."""
    device = first_logits.device
    eos = eos_token_ids(model, tokenizer)
    warpers = _warpers(params)
    stops = tuple(s for s in params.stop if s)
    gen = None
    if params.temperature > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    cache_kw = cache_kwarg(model)
    ids: list[int] = []
    emitted = 0
    logits = first_logits.float()[None]
    position = start_position
    finish = "length"
    for step in range(params.max_new_tokens):
        if params.temperature > 0:
            scores = warpers(torch.tensor([ids], dtype=torch.long, device=device), logits)
            token = int(torch.multinomial(scores.softmax(-1), 1, generator=gen)[0, 0])
        else:
            token = int(logits.argmax(-1)[0])
        if step == 0 and on_first_token is not None:
            on_first_token()
        if token in eos:
            finish = "stop"
            break
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            if cut > emitted:
                yield text[emitted:cut]
            return DecodeState(ids, text[:cut], "stop")
        safe = len(text) - _held_back(text, stops)
        if safe > emitted:
            yield text[emitted:safe]
            emitted = safe
        if step + 1 == params.max_new_tokens:
            break
        with torch.inference_mode():
            out = model(
                input_ids=torch.tensor([[token]], device=device),
                position_ids=torch.tensor([[position]], device=device),
                use_cache=True,
                logits_to_keep=1,
                **{cache_kw: cache},
                **(model_kwargs or {}),
            )
        position += 1
        logits = out.logits[:, -1].float()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if len(text) > emitted:
        yield text[emitted:]
    return DecodeState(ids, text, finish)
