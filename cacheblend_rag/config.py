"""Configuration dataclasses with documented defaults."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace

# full_recompute is the model's own forward; full_recompute_saved the same exact prefill with the
# last-layer saving the fused modes get (only the last position runs attention and the MLP there).
MODES = ("full_recompute", "full_recompute_saved", "prefix_caching", "full_reuse", "cacheblend")
# The modes that fuse each chunk's own cache (neighbour-aware ones included) and read a BlendConfig.
FUSED_MODES = ("full_reuse", "cacheblend")
# An adaptive recompute preset, opt-in: BlendConfig(escalation=ADAPTIVE_ESCALATION): blend again
# only the most hesitant prompts (margin < 0.1), at 0.3 and then 0.6. Chosen on dev questions as a
# cascade that costs little; its gain there was within the noise, so the default stays a fixed
# ratio (escalation=()). Its trade: docs/choosing.md, "Adaptive recompute".
ADAPTIVE_ESCALATION: tuple[tuple[float, float], ...] = ((0.1, 0.3), (0.1, 0.6))
# How the cacheblend mode picks the context tokens it recomputes (BlendConfig.strategy).
STRATEGIES = ("hkvd", "question", "chunk", "hybrid")


@dataclass(frozen=True)
class BlendConfig:
    """How the CacheBlend fusor picks the tokens it recomputes.

    recompute_ratio: fraction of the context (chunk) tokens recomputed on the layers after the
        filtering schedule has finished (paper section 4.3: ~15% keeps quality).
    criterion: how a recomputed token's KV deviation is scored on a check layer; one of
        ``cacheblend_rag.blend.selector.CRITERIA`` ("value" is the paper's, "key" is LMCache's,
        "query_value" weights the value deviation by the question's attention) or a callable.
        Default "query_value": on MuSiQue with the bundled model it was closer to full prefill
        than the paper's "value" on every question measured (docs/engine.md, "Fidelity").
    filter_layers: gradual filtering (paper 4.3, Fig. 9): layers 0 and 1 recompute every
        non-exact context token, then layers 1..filter_layers each keep a geometrically smaller
        subset of the tokens they recomputed, reaching ``recompute_ratio`` after the last of them.
        1 means "pick once, on layer 1", which is what the public implementations do.
    schedule: an explicit schedule instead: ``((layer, fraction), ...)`` with strictly
        increasing layers and non-increasing fractions of the context tokens kept after each
        check layer. Overrides ``filter_layers``; the last fraction is the final ratio.
    boundary_tokens: the first N tokens of every non-exact chunk are always recomputed. A chunk
        cached behind the instruction prefix starts where the prompt's attention sink used to
        be, so its first tokens tend to deviate most; counted inside the budget.
    strategy: which context tokens get fresh K/V. Default "question": on HotpotQA dev
        questions with Qwen2.5-Coder-0.5B it was closer to full prefill than "hkvd" at the same
        ratio, and faster (docs/quality.md).
        "hkvd" (the paper's): layers 0-1 recompute every non-exact context token, then the
        check layers keep the tokens whose K/V deviate most (``criterion``, ``filter_layers``,
        ``schedule``).
        "question" (question-guided, as ProphetKV and FusionRAG): first the question alone runs
        over the reused cache through every layer, and each context token is scored by the
        attention the question gives it (``question_layers``, ``question_heads``); the top
        ``recompute_ratio`` of the context are then recomputed on every layer, with the
        question. Later work found deviation a poor guide to what the answer reads
        (docs/quality.md).
        "chunk": the same scoring pass, then whole chunks with the most question attention are
        recomputed on every layer (at least one; more while they fit in ``recompute_ratio``).
        "hybrid": the same scoring pass seeds ``hybrid_seed`` times the budget with the tokens
        the question reads most; layers 0 and 1 recompute the seed, and layer 1's deviation
        (``criterion``) keeps ``recompute_ratio`` of the context for the remaining layers.
        Measured no closer to full prefill than "question" (docs/quality.md).
    question_layers: question-guided scoring ("question", "chunk", "hybrid"): average the
        question's attention over "all" layers (ProphetKV) or read the "last" layer (FusionRAG).
    question_heads: question-guided scoring: "mean" attention over all heads, or "max" over
        the K/V head groups of each group's mean (a token one group reads hard is kept).
    selection_window: "question" and "hybrid"'s seed: also recompute up to this many tokens
        either side of a high-scoring token (scores are max-pooled over the window before the
        top-k, so the budget holds). 0 picks tokens alone.
    hybrid_seed: "hybrid" only: the question-guided seed's size as a multiple of the final
        budget (>= 1; at 1 the check keeps the whole seed, which is "question"'s selection).
    context_temperature, context_scale: APE (arXiv 2502.05431): the question's and each
        generated token's attention logits to the chunks are divided by the temperature and
        shifted by log(scale) (APE's merge of separately encoded contexts: T = S = 0.9 in the
        paper). 1.0 and 1.0 (the default) leave attention exact. Fused modes only
        (``cacheblend``, ``full_reuse``).
    neighbour_caches: use a chunk's cross-chunk-aware cache (``engine.precompute(...,
        neighbours=n)``: prefilled behind its most similar chunks) where one was computed. The
        prompt's first chunk always uses its plain cache, which is exact there.
    guard_margin: the fidelity guard (``guard.py``), off by default (None). When the blended
        prefill's first-token margin (top-1 minus top-2 log-probability of the first answer token,
        from its own last logits) is below this, the prompt is prefilled again in full
        (``full_recompute_saved``, exact) and answered from that: the answer is full prefill's, at
        the cost of both prefills. Fused modes only (``cacheblend``, ``full_reuse``); every fused
        prefill reports ``stats["first_token_margin"]`` and ``stats["escalated"]``. Pick the
        threshold from ``python -m cacheblend_bench.guard_curve`` (share escalated, agreement
        and TTFT per threshold, from ``cacheblend-rag fidelity`` rows); ``float("inf")`` always
        escalates. When set, it is ``escalation``'s full-prefill step: ``(guard_margin, 1.0)``.
    escalation: adaptive recompute, ``((margin, ratio), ...)``: after the blended prefill at
        ``recompute_ratio``, while the latest pass's first-token margin is below the next step's
        ``margin``, the prompt is blended again at that step's larger ``ratio``; ``ratio`` 1.0 is
        an exact full prefill (``full_recompute_saved``), as the guard's. A blended answer differs
        from full prefill's mostly where the reader hesitates between two first tokens (the
        guard's reasoning), so recompute is spent on those prompts and not on every prompt alike.
        A step re-selects from the first pass's question scores over the K/V it already loaded
        (a selection at a larger ratio contains the smaller one's), so it costs its fused pass
        only, and its answer is exactly the fixed-ratio answer at that ratio. Partial steps need a
        question-guided ``strategy`` to reuse the first pass ("hkvd" runs each step afresh) and
        mode ``cacheblend``; ``full_reuse`` takes only a 1.0 step. Ratios grow strictly and stay
        in (0, 1]; steps at or below ``recompute_ratio`` are skipped. ``()``: fixed ratio.
        Stats: ``recompute_steps`` (the ratios run, 1.0 for a full prefill) and ``step_margins``.
    attention_groups: speed only, never the result: the recomputed tokens' attention runs in this
        many blocks of rows, each reading the keys up to its last position instead of the whole
        prompt (a causal prefill skips the masked half; scattered rows cannot). A minimum: a
        layer recomputing more than 512 rows (the first layers) uses more blocks of at most 512
        (``attention.MAX_BLOCK_ROWS``). Default 2: measured 5% faster than 1 on 3k-token MuSiQue
        prompts; 4 and 8 were no faster than 2 on the later layers (docs/engine.md).
    """

    recompute_ratio: float = 0.15
    criterion: str | Callable = "query_value"
    filter_layers: int = 3
    schedule: tuple[tuple[int, float], ...] | None = None
    boundary_tokens: int = 0
    attention_groups: int = 2
    strategy: str = "question"
    question_layers: str = "all"
    question_heads: str = "mean"
    selection_window: int = 0
    hybrid_seed: float = 2.0
    neighbour_caches: bool = True
    context_temperature: float = 1.0
    context_scale: float = 1.0
    guard_margin: float | None = None
    escalation: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        self._check_escalation()
        if self.guard_margin is not None and (
            isinstance(self.guard_margin, bool)
            or not isinstance(self.guard_margin, numbers.Real)
            or math.isnan(self.guard_margin)
            or self.guard_margin < 0
        ):
            raise ValueError(
                f"guard_margin={self.guard_margin!r} must be None (no guard) or a log-probability margin >= 0, "
                "e.g. 0.69 (first token less than twice as likely as the second: answer with a full prefill)"
            )
        # bool is an int (True would silently mean 1.0) and "0.5" would fail deep in a comparison.
        if isinstance(self.recompute_ratio, bool) or not isinstance(self.recompute_ratio, numbers.Real):
            raise TypeError(
                f"recompute_ratio must be a number in [0, 1], got {type(self.recompute_ratio).__name__} "
                f"{self.recompute_ratio!r}: pass e.g. 0.15"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.schedule is not None and self.strategy != "hkvd":
            raise ValueError(
                f"schedule= is HKVD's gradual filtering and strategy={self.strategy!r} would ignore it: "
                "pass strategy='hkvd' with it, or drop it and set recompute_ratio"
            )
        if self.question_layers not in ("all", "last"):
            raise ValueError(f"question_layers={self.question_layers!r}: choose 'all' or 'last'")
        if self.question_heads not in ("mean", "max"):
            raise ValueError(f"question_heads={self.question_heads!r}: choose 'mean' or 'max'")
        for name in ("context_temperature", "context_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < float("inf"):
                raise ValueError(f"{name}={value!r} must be a positive finite number (1.0: attention unchanged)")
        if (
            isinstance(self.hybrid_seed, bool)
            or not isinstance(self.hybrid_seed, numbers.Real)
            or not 1.0 <= self.hybrid_seed < float("inf")
        ):
            raise ValueError(f"hybrid_seed={self.hybrid_seed!r} must be a finite number >= 1 (the seed's size in budgets)")
        if not isinstance(self.selection_window, int) or self.selection_window < 0:
            raise ValueError(f"selection_window={self.selection_window!r} must be an int >= 0")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(
                f"recompute_ratio={self.recompute_ratio} is outside [0, 1]: it is the fraction of "
                "context tokens recomputed per layer (0.15 is the paper's default)"
            )
        # An int: 1.5 was accepted and then used as a layer count in the schedule's arithmetic.
        if isinstance(self.filter_layers, bool) or not isinstance(self.filter_layers, int) or self.filter_layers < 1:
            raise ValueError(f"filter_layers={self.filter_layers!r} must be an int >= 1 (the number of check layers)")
        if not isinstance(self.attention_groups, int) or self.attention_groups < 1:
            raise ValueError(f"attention_groups={self.attention_groups!r} must be an int >= 1 (1: one attention call)")
        if isinstance(self.boundary_tokens, bool) or not isinstance(self.boundary_tokens, int) or self.boundary_tokens < 0:
            raise ValueError(f"boundary_tokens={self.boundary_tokens!r} must be an int >= 0")
        if self.schedule is not None:
            layers = [layer for layer, _ in self.schedule]
            fracs = [f for _, f in self.schedule]
            if not self.schedule or layers != sorted(set(layers)) or layers[0] < 0:
                raise ValueError(
                    f"schedule={self.schedule!r}: give ((layer, fraction), ...) with strictly "
                    "increasing, non-negative layer indices"
                )
            if any(not 0.0 <= f <= 1.0 for f in fracs) or fracs != sorted(fracs, reverse=True):
                raise ValueError(f"schedule={self.schedule!r}: fractions must lie in [0, 1] and never grow")

    def _check_escalation(self) -> None:
        steps = self.escalation
        if isinstance(steps, list):
            object.__setattr__(
                self, "escalation", steps := tuple(tuple(step) if isinstance(step, list) else step for step in steps)
            )
        hint = "pass ((margin, ratio), ...), e.g. ((1.0, 0.3), (0.5, 1.0)): below margin 1.0 blend again at 0.3, then full prefill below 0.5"
        if not isinstance(steps, tuple) or not all(isinstance(step, tuple) and len(step) == 2 for step in steps):
            raise ValueError(f"escalation={steps!r}: {hint}")
        previous = 0.0
        for margin, ratio in steps:
            for name, value in (("margin", margin), ("ratio", ratio)):
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value < 0:
                    raise ValueError(f"escalation step ({margin!r}, {ratio!r}): the {name} must be a number >= 0; {hint}")
            if not previous < ratio <= 1.0:
                raise ValueError(
                    f"escalation step ({margin!r}, {ratio!r}): each ratio must be larger than the one before "
                    f"and at most 1.0 (a full prefill); {hint}"
                )
            previous = ratio

    def escalation_steps(self) -> tuple[tuple[float, float], ...]:
        """The steps after the first pass that can run: those above ``recompute_ratio``, and
        ``guard_margin`` as a last full-prefill step."""
        steps = [step for step in self.escalation if step[1] > self.recompute_ratio]
        if self.guard_margin is not None:
            steps = [step for step in steps if step[1] < 1.0] + [(self.guard_margin, 1.0)]
        return tuple(steps)

    @property
    def reweights_context(self) -> bool:
        return self.context_temperature != 1.0 or self.context_scale != 1.0

    def with_ratio(self, ratio: float | None) -> BlendConfig:
        if ratio is None:
            return self
        return replace(self, recompute_ratio=ratio, schedule=None)

    def check_points(self) -> list[tuple[int, float]]:
        """The (layer, fraction of context kept after it) pairs of this schedule."""
        if self.schedule is not None:
            return list(self.schedule)
        r, n = self.recompute_ratio, self.filter_layers
        # Checks start on layer 1: layer 0's K/V depend only on each token and its position, so
        # its fresh-vs-cached deviation is rounding noise and would select at random. Layer 0 is
        # recomputed in full to give layer 1 correct inputs; layer 1 is the first with signal.
        first = 1
        if r <= 0.0:
            return [(first + i, 0.0) for i in range(n)]
        # Geometric shrink: each check layer keeps the same share of what it recomputed.
        return [(first + i, math.pow(r, (i + 1) / n)) for i in range(n)]


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    return mode
