"""Answer matching for QA: the official SQuAD / HotpotQA normalization, exact match and token F1.

Follows the HotpotQA evaluation script: answers are compared after lowercasing, removing
punctuation, removing the articles a/an/the and collapsing whitespace; F1 is over whitespace
tokens, and a "yes" / "no" / "noanswer" on either side only scores when both sides are equal.
Difference: the official script scores one gold answer; here every metric is the maximum over the
gold answer and its aliases (as the SQuAD script does over its several golds).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CLOSED_ANSWERS = ("yes", "no", "noanswer")  # HotpotQA: no partial credit for these


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop articles, collapse whitespace (in that order)."""
    lowered = text.lower()
    without_punctuation = "".join(ch for ch in lowered if ch not in _PUNCTUATION)
    without_articles = _ARTICLES.sub(" ", without_punctuation)
    return " ".join(without_articles.split())


def _check_golds(golds: Sequence[str]) -> None:
    if isinstance(golds, str):
        raise TypeError("golds must be a sequence of answers (gold first, then aliases), not one string")
    if len(golds) == 0:
        raise ValueError("no gold answers to compare with; a prompt needs at least one answer")


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0."""
    _check_golds(golds)
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(gold) for gold in golds))


def _f1_one(prediction: str, gold: str) -> float:
    predicted, expected = normalize_answer(prediction), normalize_answer(gold)
    if (predicted in _CLOSED_ANSWERS or expected in _CLOSED_ANSWERS) and predicted != expected:
        return 0.0
    predicted_tokens, expected_tokens = predicted.split(), expected.split()
    overlap = sum((Counter(predicted_tokens) & Counter(expected_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(predicted_tokens)
    recall = overlap / len(expected_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """Token F1 between the normalized prediction and the best-matching gold answer."""
    _check_golds(golds)
    return max(_f1_one(prediction, gold) for gold in golds)
