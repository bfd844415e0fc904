"""The fidelity guard: answer with a full prefill when the blended prefill is unsure of its first token.

A blended prefill's answer differs from full prefill's mostly where the reader itself hesitates:
when the two most likely first tokens are close, a small error in the reused K/V swaps them and
with them the whole greedy answer. The margin between them is known from the prefill's own last
logits before any token is returned, so ``BlendConfig(guard_margin=m)`` recomputes the prompt with
a full prefill (``full_recompute_saved``, exact) whenever the blended margin is below ``m``. The
answer then costs the blended prefill plus a full one; ``python -m cacheblend_bench.guard_curve``
shows, from ``fidelity`` rows, what each threshold costs and gains.
"""

from __future__ import annotations

import torch

__all__ = ["ESCALATED", "MARGIN", "escalates", "first_token_margin"]

# Stats keys of a guarded prefill (every fused prefill reports both).
MARGIN = "first_token_margin"
ESCALATED = "escalated"


def first_token_margin(logits: torch.Tensor) -> float:
    """Log-probability gap between the two most likely next tokens (``logits``: [vocab]); 0 for a tie."""
    top = torch.log_softmax(logits.float().reshape(-1), -1).topk(2).values
    return float(top[0] - top[1])


def escalates(margin: float, threshold: float | None) -> bool:
    """Whether a prefill whose first-token margin is ``margin`` is redone with a full prefill
    (``threshold`` None: the guard is off)."""
    return threshold is not None and margin < threshold
