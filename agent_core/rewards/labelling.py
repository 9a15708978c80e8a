"""Reward labelling: the env's process rewards per step plus a scorer's outcome reward at the end.

The outcome reward sits on the episode's terminal step; every other step carries only its process
reward. EM/F1/format are reported on the terminal step only (NULL elsewhere), so `avg(em)` over
the rewards table is a per-episode average.

`reward` is the combined reward every later stage uses (``agent_core.rewards.combine``): outcome
+ process_factor * process reward, where process_factor = process_weight times the batch's
normalizer; it is computed here and only here, over the whole labelled batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from agent_core.episodes import episodes_from_rows
from agent_core.rewards.combine import combine_rewards, process_factor
from agent_core.rewards.scorers import SCORERS, Score


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
    process_factor: float  # what process_reward was multiplied by in `reward`
    reward: float  # outcome_reward + process_factor * process_reward: the reward trained on
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


def _outcomes(steps: Sequence[StepOutcome], answers_by_prompt: Mapping[str, Sequence[str]], score_fn,
              format_weight: float) -> dict[tuple[str, int], Score | None]:
    """The scorer's Score of each terminal step, None for the others, by (episode_id, step_idx)."""
    scores: dict[tuple[str, int], Score | None] = {}
    for step in steps:
        if step.prompt_id not in answers_by_prompt:
            raise KeyError(f"step {step.episode_id}/{step.step_idx}: prompt {step.prompt_id!r} is not in the prompts table")
        scores[step.episode_id, step.step_idx] = (
            score_fn(final_answer(step), answers_by_prompt[step.prompt_id], format_weight=format_weight)
            if step.done else None
        )
    return scores


def label_steps(
    steps: Sequence[StepOutcome],
    answers_by_prompt: Mapping[str, Sequence[str]],
    *,
    scorer: str,
    format_weight: float,
    process_weight: float = 1.0,
    process_norm: str = "none",
) -> list[RewardRecord]:
    """One record per step, episode by episode in step order: its process and outcome rewards and
    the combined reward (``agent_core.rewards.combine.combine_rewards`` over the whole batch:
    process rewards scaled by process_weight and the normalizer `process_norm`)."""
    scores = _outcomes(steps, answers_by_prompt, SCORERS.get(scorer), format_weight)
    episodes = episodes_from_rows(steps)  # checks step_idx and group_id per episode
    process = [[s.env_reward for s in e.steps] for e in episodes]
    outcome = [[scores[s.episode_id, s.step_idx].outcome if s.done else 0.0 for s in e.steps] for e in episodes]
    combined = combine_rewards(process, outcome, process_weight=process_weight, normalize=process_norm)
    factor = process_factor(process, process_weight=process_weight, normalize=process_norm)
    records = []
    for episode, episode_outcomes, episode_rewards in zip(episodes, outcome, combined):
        for step, step_outcome, reward in zip(episode.steps, episode_outcomes, episode_rewards):
            score = scores[step.episode_id, step.step_idx]
            records.append(RewardRecord(
                episode_id=step.episode_id, group_id=step.group_id, prompt_id=step.prompt_id,
                sample_idx=step.sample_idx, step_idx=step.step_idx, process_reward=step.env_reward,
                outcome_reward=step_outcome, process_factor=factor, reward=reward,
                em=score.em if score else None, f1=score.f1 if score else None,
                format_score=score.format_score if score else None,
                components=json.dumps(score.components if score else {}), scorer=scorer,
            ))
    return records
