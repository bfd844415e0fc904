"""Decoding from a prefilled cache: greedy or sampled, streaming text deltas, stop strings."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from cacheblend_rag.decode.cache import with_room
from cacheblend_rag.decode.sampling import SamplingParams
from cacheblend_rag.model.backbone import cache_kwarg


@dataclass
class DecodeState:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    token_times: list[float] = field(default_factory=list)  # perf_counter() when each token was chosen


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


class StopMatcher:
    """Finds the first stop string in a growing text, and how much of its end must be held back.

    An Aho-Corasick automaton over the stop strings: each new character costs one transition
    (amortised), however many stops there are and however long, where checking every stop against
    the text costs (number of stops x their length) per token, and a request with many long stops
    held the server for minutes. Building it costs the stops' total length, once per answer.

    The state after a character is the longest suffix of the text that is a prefix of some stop,
    so its depth is exactly what could still grow into a stop (the held-back length).
    """

    def __init__(self, stops: tuple[str, ...]):
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._ends = [0]  # length of the longest stop that is a suffix of the state's string
        for s in stops:
            state = 0
            for ch in s:
                nxt = self._goto[state].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[state][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[state] + 1)
                    self._ends.append(0)
                state = nxt
            self._ends[state] = len(s)
        self._fail = [0] * len(self._goto)
        queue = list(self._goto[0].values())
        for state in queue:  # breadth first: a state's fail link is shallower, so already known
            for ch, nxt in self._goto[state].items():
                f = self._fail[state]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                back = self._goto[f].get(ch, 0)
                self._fail[nxt] = back if back != nxt else 0
                if not self._ends[nxt]:
                    self._ends[nxt] = self._ends[self._fail[nxt]]
                queue.append(nxt)
        self._text = ""
        self._states = [0]  # the state after each prefix of the text matched so far

    def _step(self, state: int, ch: str) -> int:
        goto, fail = self._goto, self._fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)

    def feed(self, text: str) -> tuple[int, int]:
        """Match ``text`` (the whole answer so far). Returns (cut, hold): the start of the earliest
        stop in it (-1: none) and how many characters at its end could still grow into one.

        Only characters not matched before are stepped through. A text that changed before its end
        (a detokenizer that rewrote its last characters) is matched again from where it changed.
        """
        keep = len(self._text)
        if not text.startswith(self._text):
            keep = 0
            for a, b in zip(text, self._text):
                if a != b:
                    break
                keep += 1
        del self._states[keep + 1 :]
        state, cut = self._states[keep], -1
        for i in range(keep, len(text)):
            state = self._step(state, text[i])
            self._states.append(state)
            n = self._ends[state]
            if n and (cut < 0 or i - n + 1 < cut):
                cut = i - n + 1
        self._text = text
        hold = 1 if text.endswith("\ufffd") else 0  # an incomplete UTF-8 sequence
        return cut, max(hold, min(self._depth[state], len(text)))


class Decoder:
    """One answer's decoding state: picks each token (greedy or sampled) and turns the tokens into
    text deltas, holding back what could still grow into a stop string. Shared by the one-answer
    loop (:func:`decode`) and the batched one (``serving.batcher.DecodeBatch``), so both stop, sample and
    stream alike."""

    def __init__(self, tokenizer, eos: set[int], params: SamplingParams, device: torch.device | str = "cpu"):
        self.tokenizer, self.params = tokenizer, params
        self.eos = set() if params.ignore_eos else eos
        self.warpers = _warpers(params)
        self.stops = tuple(s for s in params.stop if s)
        self._matcher = StopMatcher(self.stops)
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # set once the answer is complete
        self._emitted = 0
        # Constrained decoding: this answer's place in the grammar (constraints.Matcher).
        self.matcher = None if params.constraint is None else params.constraint.start(tokenizer, eos)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from this answer's next-token ``logits`` ([vocab])."""
        logits = logits.float().reshape(1, -1)
        if self.params.temperature > 0:
            if self.matcher is not None:
                logits = self.matcher.mask(logits.clone())
            ids = torch.tensor([self.token_ids], dtype=torch.long, device=logits.device)
            scores = self.warpers(ids, logits)
            return int(torch.multinomial(scores.softmax(-1), 1, generator=self.generator)[0, 0])
        if self.matcher is not None:
            return self.matcher.greedy(logits)
        return int(logits.argmax(-1)[0])

    def accept(self, token: int) -> str:
        """Add ``token``; return the text that became final (possibly ""). Sets ``finish_reason``
        on EOS, a stop string, the token budget or the end of the constraint's grammar."""
        if self.matcher is not None:
            self.matcher.advance(token)
        if token in self.eos:
            self.finish_reason = "stop"
            return self._flush()
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut, hold = self._matcher.feed(text)
        if cut >= 0:
            delta = text[self._emitted : cut] if cut > self._emitted else ""
            self.text, self._emitted, self.finish_reason = text[:cut], cut, "stop"
            return delta
        self.text = text
        safe = len(text) - hold
        delta = ""
        if safe > self._emitted:
            delta, self._emitted = text[self._emitted : safe], safe
        if self.matcher is not None and self.matcher.done:
            # The grammar allows nothing but end-of-sequence now (even with ignore_eos): the step
            # that would choose it is not run.
            self.finish_reason = "stop"
            delta += self._flush()
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
            delta += self._flush()
        return delta

    def _flush(self) -> str:
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def state(self) -> DecodeState:
        return DecodeState(self.token_ids, self.text, self.finish_reason or "length")


def decode(
    model,
    tokenizer,
    cache,
    first_logits: torch.Tensor,
    start_position: int,
    params: SamplingParams,
    on_first_token: Callable[[], None] | None = None,
    model_kwargs: dict | None = None,
    step: Callable[[int, int, Any], torch.Tensor] | None = None,
) -> Iterator[str]:
    """Yield text deltas; the generator's return value is the final ``DecodeState``.

    ``step(token, position, cache) -> logits [vocab]`` (``decode_step.FastDecodeStep``) replaces
    the model's forward for each token unless ``model_kwargs`` asks the forward for more."""
    device = first_logits.device
    decoder = Decoder(tokenizer, eos_token_ids(model, tokenizer), params, device)
    cache_kw = cache_kwarg(model)
    logits = first_logits
    position = start_position
    times: list[float] = []
    while True:
        token = decoder.choose(logits)
        times.append(time.perf_counter())
        if len(times) == 1 and on_first_token is not None:
            on_first_token()
        delta = decoder.accept(token)
        if delta:
            yield delta
        if decoder.done:
            state = decoder.state()
            state.token_times = times[: len(state.token_ids)]
            return state
        if position == start_position:  # after the first token: TTFT does not pay for the copy
            cache = with_room(cache, params.max_new_tokens)
        if step is not None and not model_kwargs:
            logits = step(token, position, cache)
        else:
            with torch.inference_mode():
                out = model(
                    input_ids=torch.tensor([[token]], device=device),
                    position_ids=torch.tensor([[position]], device=device),
                    use_cache=True,
                    logits_to_keep=1,
                    **{cache_kw: cache},
                    **(model_kwargs or {}),
                )
            logits = out.logits[0, -1]
        position += 1
