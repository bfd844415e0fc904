"""Quality metrics: LongBench-style answer F1 and fidelity of a mode to full prefill."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

import torch


def normalize_answer(s: str) -> str:
    """LongBench/SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: Iterable[str]) -> float:
    """Best F1 of the prediction against any gold answer."""
    return max((token_f1(prediction, a) for a in answers), default=0.0)


def next_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || candidate) of the next-token distributions, in nats. Two distributions that
    differ by float32 rounding alone can sum to a tiny negative; a divergence is never below 0."""
    p = torch.log_softmax(reference_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))
