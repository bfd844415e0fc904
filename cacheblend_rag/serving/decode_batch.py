"""The decode part of continuous batching: every running answer advanced one token in one forward.

Owns :class:`DecodeBatch`: the running answers' rows, their shared left-padded cache and mask, the
first token chosen from a prefill's logits (:meth:`DecodeBatch.start`), one decode step for every
row (:meth:`DecodeBatch.step`), and rows leaving when finished or cancelled. Where each row's
text goes is its :class:`AnswerSink` (the batcher's ``Ticket``). Scheduling (who is admitted,
when prefills run) is the batcher's (``batcher.py``).

One decode step reads all of the model's weights to produce a single token per answer. That read,
not the arithmetic, bounds the step on a CPU as on a GPU, so a step for B answers costs little more
than a step for one.

Answers of different prompt lengths share one cache through left padding. A row's keys stay where
its own prefill put them (rotated for its own positions), its padding is masked out, and each new
token carries the row's own position id, so a row's logits are the ones it would get decoded alone
(up to the order of floating-point sums). A batch of one row decodes with the engine's fast decode
step, as an answer served alone does, so one request at a time costs what it costs without a batcher.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from cacheblend_rag.decode.cache import stacked_cache
from cacheblend_rag.decode.generation import Decoder, DecodeState, eos_token_ids
from cacheblend_rag.decode.sampling import SamplingParams
from cacheblend_rag.model.backbone import cache_kwarg

if TYPE_CHECKING:
    from cacheblend_rag.decode.step import FastDecodeStep


class AnswerSink(Protocol):
    """Where a row's answer goes: ``first_token`` once its first token is chosen, ``delta`` for
    each piece of text that became final, then ``done`` (or ``fail``) once.

    ``cancelled`` turns true (from any thread) once nobody wants the rest of the answer: the row
    leaves the batch before the next step, with ``done`` and finish reason ``"cancelled"``."""

    @property
    def cancelled(self) -> bool: ...

    def first_token(self) -> None: ...

    def delta(self, text: str) -> None: ...

    def done(self, state: DecodeState) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


@dataclass
class _Row:
    decoder: Decoder
    sink: AnswerSink
    token: int  # fed on the next step
    position: int  # that token's position in the row's own sequence


def _layer_kv(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [lay.keys for lay in cache.layers], [lay.values for lay in cache.layers]


class DecodeBatch:
    """The running answers: one cache (``decode_cache.RoomLayer`` per layer, [rows, kv_heads,
    length, head_dim], so each step writes its token in place), left padded to the longest row,
    and a ``[rows, length]`` mask (1: a real key, 0: padding).

    ``fast_step`` (the engine's ``FastDecodeStep``, if its model has one) replaces the model's
    forward: the same arithmetic in fewer operations. A batch of one row takes exactly the step an
    answer decoded alone takes."""

    def __init__(self, model, tokenizer, fast_step: FastDecodeStep | None = None):
        self.model, self.tokenizer, self.fast_step = model, tokenizer, fast_step
        self.eos: set[int] | None = None  # looked up on the first start(): the model is not touched before
        self.cache_kw = ""
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, length]

    def __len__(self) -> int:
        return len(self.rows)

    def start(
        self, cache: DynamicCache, first_logits: torch.Tensor, length: int, params: SamplingParams, sink: AnswerSink
    ) -> None:
        """Choose the answer's first token from its prefill's ``first_logits`` ([vocab]); unless
        that ends the answer, the prefill ``cache`` (``length`` positions, batch 1, handed over)
        joins the batch."""
        if self.eos is None:
            self.eos, self.cache_kw = eos_token_ids(self.model, self.tokenizer), cache_kwarg(self.model)
        decoder = Decoder(self.tokenizer, self.eos, params, first_logits.device)
        token = decoder.choose(first_logits)
        sink.first_token()
        text = decoder.accept(token)
        if text:
            sink.delta(text)
        if decoder.done:
            sink.done(decoder.state())
            return
        keys, values = _layer_kv(cache)
        rows = self._row_kv(range(len(self.rows)))
        rows.append(([k[0, :, :length] for k in keys], [v[0, :, :length] for v in values]))  # [kv_heads, length, head_dim]
        mask = torch.ones(1, length, dtype=torch.long, device=first_logits.device)
        if self.mask is not None:
            width = max(self.mask.shape[1], length)
            mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.rows.append(_Row(decoder, sink, token, length))
        self.cache, self.mask = stacked_cache(rows, self._room()), mask

    def _row_kv(self, rows: Iterable[int], first: int = 0) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Views of the given rows' per-layer K/V from column ``first`` on, for ``stacked_cache``."""
        if self.cache is None:
            return []
        keys, values = _layer_kv(self.cache)
        return [([k[i, :, first:] for k in keys], [v[i, :, first:] for v in values]) for i in rows]

    def _room(self) -> int:
        # Positions the longest-running answer may still add: the cache need not grow again.
        return max(r.decoder.params.max_new_tokens - len(r.decoder.token_ids) for r in self.rows)

    @torch.inference_mode()
    def step(self) -> int:
        """One token for every running answer; finished answers leave the batch after the step,
        cancelled ones before it. Returns how many answers the step advanced."""
        # A cancelled answer leaves the way a finished one does, so its row costs no more steps.
        keep = []
        for i, row in enumerate(self.rows):
            if row.sink.cancelled:
                row.sink.done(cancelled_state(row.decoder.token_ids, row.decoder.text))
            else:
                keep.append(i)
        if len(keep) < len(self.rows):
            self._keep(keep)
        if not self.rows:
            return 0
        stepped = len(self.rows)
        assert self.mask is not None and self.cache is not None
        device = self.mask.device
        mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=self.mask.dtype, device=device)], dim=1)
        if self.fast_step is not None and len(self.rows) == 1 and bool(self.mask.all()):
            # One row never has padding (_keep drops the columns no row needs): it is an answer
            # decoded alone, and takes the step such an answer takes.
            row = self.rows[0]
            logits = self.fast_step(row.token, row.position, self.cache)[None]  # [1, vocab]
        elif self.fast_step is not None:
            logits = self.fast_step.batched([r.token for r in self.rows], [r.position for r in self.rows], self.cache, mask)
        else:
            logits = self.model(
                input_ids=torch.tensor([[r.token] for r in self.rows], device=device),
                position_ids=torch.tensor([[r.position] for r in self.rows], device=device),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kw: self.cache},
            ).logits[:, -1]
        self.mask = mask
        keep = []
        for i, row in enumerate(self.rows):
            row.position += 1
            row.token = row.decoder.choose(logits[i])
            text = row.decoder.accept(row.token)
            if text:
                row.sink.delta(text)
            if row.decoder.done:
                row.sink.done(row.decoder.state())
            else:
                keep.append(i)
        if len(keep) < len(self.rows):
            self._keep(keep)
        return stepped

    def _keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]
        if not self.rows:
            self.cache, self.mask = None, None
            return
        assert self.mask is not None and self.cache is not None
        mask = self.mask[torch.tensor(rows, device=self.mask.device)]
        # Drop the padding columns no remaining row needs (the row that left was the longest).
        first = int(mask.any(0).nonzero()[0])
        self.mask = mask[:, first:]
        self.cache = stacked_cache(self._row_kv(rows, first), self._room())


def cancelled_state(token_ids: list[int], text: str) -> DecodeState:
    """What a cancelled answer had decoded when it stopped."""
    return DecodeState(list(token_ids), text, "cancelled")


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` ([..., length, head_dim] K/V or a [rows, length] mask) left-padded with zeros to ``width``."""
    if t.dim() == 2:
        return F.pad(t, (width - t.shape[1], 0))
    return F.pad(t, (0, 0, width - t.shape[-2], 0))
