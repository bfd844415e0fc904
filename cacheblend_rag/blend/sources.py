"""Sources: how much of the question's attention each retrieved chunk received.

Question-guided selection (``BlendConfig.strategy`` "question", the default, "chunk" and
"hybrid") first runs the question alone over the reused chunk caches and reads its attention to
every prompt position (``fusor.question_pass``). Summed over each chunk's tokens, that attention
says which documents the question reads, at no extra cost: the scores exist anyway.

``stats["chunk_attention"]`` is that share, one float per chunk in prompt order. Precisely:

* the attention rows are the question segment's tokens (``Question: ...``, any answer hint and
  the chat template's closing turn and assistant header), over every key of the prompt;
* per layer, the softmax attention probabilities, averaged over the question's tokens and over
  the attention heads (``question_heads="mean"``; with ``"max"``, the largest of the K/V head
  groups' means), then averaged over all layers (``question_layers="all"``, the default) or
  taken from the last layer (``"last"``);
* per chunk, the sum over its tokens (its text and the blank line after it), divided by the sum
  over all chunks: the shares add up to 1, and the attention the question gives the instruction
  and itself is left out;
* the chunks are those the engine prefilled: the request's chunks in order, with an exact repeat
  of an earlier chunk dropped (``prompt.normalize_chunks``); :func:`attention_by_text` maps the
  shares back onto the texts as the caller passed them.

The question reads the chunks' cached K/V here (each chunk was prefilled alone), not the K/V a
full prefill would give them. Other modes (``full_recompute``, ``prefix_caching``,
``full_reuse``, ``strategy="hkvd"``) do not run this pass and their stats have no
``chunk_attention``: computing it there would add a pass of the question through every layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cacheblend_rag.chat.prompt import PromptLayout

STATS_KEY = "chunk_attention"

__all__ = ["STATS_KEY", "attention_by_text", "chunk_attention"]


def chunk_attention(scores: torch.Tensor, layout: PromptLayout) -> list[float]:
    """Each chunk's share of the question's attention to the chunks, in prompt order.

    ``scores`` [len(layout)]: the question's attention to every prompt position
    (``fusor.QuestionPass.scores``). Shares sum to 1; if the chunks got no attention at all
    (underflow), each gets an equal share.
    """
    spans = [(off, off + len(seg)) for seg, off in zip(layout.segments, layout.offsets()) if seg.reusable]
    if not spans:
        return []
    if scores.numel() != len(layout):
        raise ValueError(f"scores cover {scores.numel()} positions, the prompt has {len(layout)}")
    s = scores.detach().double().cpu()
    mass = [float(s[a:b].sum()) for a, b in spans]
    total = sum(mass)
    if not total > 0 or not math.isfinite(total):
        return [1.0 / len(spans)] * len(spans)
    return [m / total for m in mass]


def attention_by_text(texts: Sequence[str], attention: Sequence[float]) -> list[float | None]:
    """The attention share of each of ``texts`` (the chunks as a caller passed them, in order).

    The engine drops blank texts' and exact repeats' chunks (an integration leaves blank documents
    out; ``normalize_chunks`` drops repeats), so those get None; every other text gets its chunk's
    share. Raises ValueError when ``attention`` does not have one share per remaining text (the
    texts are not the ones the answer was prefilled over).
    """
    seen: set[str] = set()
    out: list[float | None] = []
    shares = iter(attention)
    for text in texts:
        if not text.strip() or text in seen:
            out.append(None)
            continue
        seen.add(text)
        share = next(shares, None)
        if share is None:
            break
        out.append(float(share))
    if len(seen) != len(attention) or len(out) != len(texts):
        raise ValueError(
            f"{len(attention)} chunk attention shares for {len(seen)} distinct non-blank texts: pass the "
            "texts the answer was generated over, in the same order"
        )
    return out
