"""Outcome scorers by name: an episode's final answer + the gold answers -> a `Score`.

Every scorer has the signature `(final_answer, answers, *, format_weight) -> Score`.
`final_answer` is None when the episode ended without a well-formed answer (budget exhausted or
only invalid actions); that scores 0 on every match metric and 0 on format. The outcome is the
match metric plus `format_weight` times the format score, the Search-R1 style format bonus that
gives a weak policy a signal before it ever answers correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from agent_core.registry import Registry
from agent_core.rewards.qa import exact_match, f1_score


@dataclass(frozen=True)
class Score:
    """outcome: the reward of the episode. em, f1: match metrics (always both, for reporting).
    format_score: 1.0 for a well-formed final answer. components: the named parts, for the
    rewards table (em, f1, format)."""

    outcome: float
    em: float
    f1: float
    format_score: float
    components: dict[str, float] = field(default_factory=dict)


Scorer = Callable[..., Score]  # (final_answer: str | None, answers: Sequence[str], *, format_weight: float)

SCORERS: Registry[Scorer] = Registry("scorer")


def _match(final_answer: str | None, answers: Sequence[str]) -> tuple[float, float, float]:
    """(em, f1, format_score) of one final answer."""
    if len(answers) == 0:  # a data error even when there is no answer to compare
        raise ValueError("no gold answers to score against; a prompt needs at least one answer")
    if final_answer is None:
        return 0.0, 0.0, 0.0
    return exact_match(final_answer, answers), f1_score(final_answer, answers), 1.0


def _score(metric: float, em: float, f1: float, format_score: float, format_weight: float) -> Score:
    return Score(
        outcome=metric + format_weight * format_score,
        em=em,
        f1=f1,
        format_score=format_score,
        components={"em": em, "f1": f1, "format": format_score},
    )


@SCORERS.register("qa_em")
def qa_em(final_answer: str | None, answers: Sequence[str], *, format_weight: float) -> Score:
    """outcome = exact match + format_weight * format."""
    em, f1, format_score = _match(final_answer, answers)
    return _score(em, em, f1, format_score, format_weight)


@SCORERS.register("qa_f1")
def qa_f1(final_answer: str | None, answers: Sequence[str], *, format_weight: float) -> Score:
    """outcome = token F1 + format_weight * format."""
    em, f1, format_score = _match(final_answer, answers)
    return _score(f1, em, f1, format_score, format_weight)
