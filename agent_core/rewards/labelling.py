"""Reward labelling: the env's process rewards per step plus a scorer's outcome reward at the end.

The outcome reward sits on the episode's terminal step; every other step carries only its process
reward. EM/F1/format are reported on the terminal step only (NULL elsewhere), so `avg(em)` over
the rewards table is a per-episode average.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from agent_core.rewards.scorers import SCORERS


@dataclass(frozen=True)
class StepOutcome:
    """What labelling needs from a `steps` row."""

    episode_id: str
    group_id: str
    prompt_id: str
    sample_idx: int
    step_idx: int
    env_reward: float
    done: bool
    termination: str | None
    info: str  # JSON; the env puts the final answer under "answer"


@dataclass(frozen=True)
class RewardRecord:
    episode_id: str
    group_id: str
    prompt_id: str
    sample_idx: int
    step_idx: int
    process_reward: float
    outcome_reward: float
    reward: float
    em: float | None
    f1: float | None
    format_score: float | None
    components: str
    scorer: str


def final_answer(step: StepOutcome) -> str | None:
    """The answer the agent gave, or None if the episode ended any other way."""
    if step.termination != "answered":
        return None
    answer = json.loads(step.info).get("answer")
    return answer if isinstance(answer, str) else None


def label_steps(
    steps: Sequence[StepOutcome],
    answers_by_prompt: Mapping[str, Sequence[str]],
    *,
    scorer: str,
    format_weight: float,
) -> list[RewardRecord]:
    score_fn = SCORERS.get(scorer)
    records = []
    for step in steps:
        if step.prompt_id not in answers_by_prompt:
            raise KeyError(f"step {step.episode_id}/{step.step_idx}: prompt {step.prompt_id!r} is not in the prompts table")
        outcome, em, f1, fmt, components = 0.0, None, None, None, {}
        if step.done:
            score = score_fn(final_answer(step), answers_by_prompt[step.prompt_id], format_weight=format_weight)
            outcome, em, f1, fmt, components = score.outcome, score.em, score.f1, score.format_score, score.components
        records.append(
            RewardRecord(
                episode_id=step.episode_id,
                group_id=step.group_id,
                prompt_id=step.prompt_id,
                sample_idx=step.sample_idx,
                step_idx=step.step_idx,
                process_reward=step.env_reward,
                outcome_reward=outcome,
                reward=step.env_reward + outcome,
                em=em,
                f1=f1,
                format_score=fmt,
                components=json.dumps(components),
                scorer=scorer,
            )
        )
    return records
