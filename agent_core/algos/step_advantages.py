"""From per-step rewards to per-token advantages of each step (the compute_advantages stage).

Steps are grouped into episodes, episodes into groups (same prompt), the estimator runs on the
episode token layout (agent_core.algos.episodes), and the result is split back into one list of
floats per step, aligned with that step's response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agent_core.algos.advantages import compute_advantages
from agent_core.algos.episodes import pack_step_rewards, unpack_steps


@dataclass(frozen=True)
class StepReward:
    episode_id: str
    group_id: str
    step_idx: int
    response_length: int
    reward: float


@dataclass(frozen=True)
class StepAdvantage:
    episode_id: str
    step_idx: int
    advantages: list[float]
    returns: list[float]


def advantages_for_steps(
    steps: Sequence[StepReward],
    *,
    estimator: str,
    gamma: float,
    lam: float,
    eps: float,
    norm_by_std: bool,
) -> list[StepAdvantage]:
    """Run `estimator` over the episodes formed by `steps` (any order) and split per step."""
    episodes: dict[str, list[StepReward]] = {}
    for step in steps:
        episodes.setdefault(step.episode_id, []).append(step)
    ordered = [sorted(rows, key=lambda s: s.step_idx) for rows in episodes.values()]
    group_names = {name: i for i, name in enumerate(dict.fromkeys(rows[0].group_id for rows in ordered))}
    layout = pack_step_rewards(
        [[s.response_length for s in rows] for rows in ordered],
        [[s.reward for s in rows] for rows in ordered],
    )
    group_index = torch.tensor([group_names[rows[0].group_id] for rows in ordered], dtype=torch.long)
    output = compute_advantages(
        estimator, layout.token_rewards, layout.mask, group_index, None,
        gamma=gamma, lam=lam, eps=eps, norm_by_std=norm_by_std,
    )
    per_step_adv = unpack_steps(output.advantages, layout)
    per_step_ret = unpack_steps(output.returns, layout)
    return [
        StepAdvantage(step.episode_id, step.step_idx, adv, ret)
        for rows, ep_adv, ep_ret in zip(ordered, per_step_adv, per_step_ret)
        for step, adv, ret in zip(rows, ep_adv, ep_ret)
    ]
