"""From per-step rewards to per-token advantages of each step (the compute_advantages stage).

Two calls, so a caller can run a critic or reference model between them:

1. ``prepare_episodes(rows, ...)``: group steps into episodes (ordered by step_idx) and episodes
   into groups (same group_id), combine process and outcome rewards (``agent_core.algos.rewards``)
   and build the token grid (``agent_core.algos.episodes``).
2. ``estimate_step_advantages(batch, ...)``: subtract an optional in-reward KL penalty, run the
   estimator under the advantage mask, and split the result back into one record per step,
   aligned with its response tokens (and with its observation tokens when the mask is off).

``advantages_for_steps`` does both in one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from agent_core.algos.advantages import compute_advantages
from agent_core.algos.episodes import EpisodeLayout, EpisodeStep, advantage_mask, build_episode_layout, unpack
from agent_core.algos.rewards import combine_rewards

GridSource = Union[torch.Tensor, Callable[[EpisodeLayout], torch.Tensor], None]


@dataclass(frozen=True)
class StepRewardRow:
    """One step of the steps table joined with its rewards row."""

    episode_id: str
    group_id: str
    step_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    process_reward: float
    outcome_reward: float


@dataclass(frozen=True)
class StepAdvantage:
    """Per-token results of one step. advantages, returns, values align with its response_ids;
    obs_* with the observation tokens after the response, set only when the advantage mask is
    off and the step has observation tokens in the grid (None otherwise). values and obs_values
    are None without a critic."""

    episode_id: str
    step_idx: int
    advantages: list[float]
    returns: list[float]
    values: list[float] | None
    obs_advantages: list[float] | None
    obs_returns: list[float] | None
    obs_values: list[float] | None


@dataclass(frozen=True)
class EpisodeBatch:
    """Episodes ready for an estimator: the grid, each episode's group number and its steps."""

    layout: EpisodeLayout
    group_index: torch.Tensor
    episode_ids: tuple[str, ...]
    episode_steps: tuple[tuple[StepRewardRow, ...], ...]


def _episodes_in_order(rows: Sequence[StepRewardRow]) -> list[list[StepRewardRow]]:
    by_episode: dict[str, list[StepRewardRow]] = {}
    for row in rows:
        by_episode.setdefault(row.episode_id, []).append(row)
    episodes = []
    for episode_id, steps in by_episode.items():
        steps = sorted(steps, key=lambda s: s.step_idx)
        indices = [s.step_idx for s in steps]
        if indices != list(range(len(steps))):
            raise ValueError(f"episode {episode_id!r}: step_idx must run 0..{len(steps) - 1}; got {indices}")
        groups = sorted({s.group_id for s in steps})
        if len(groups) != 1:
            raise ValueError(f"episode {episode_id!r}: steps disagree on group_id: {groups}")
        episodes.append(steps)
    return episodes


def prepare_episodes(
    rows: Sequence[StepRewardRow], *, process_weight: float, process_norm: str
) -> EpisodeBatch:
    """Episodes, groups, combined per-step rewards and the token grid of `rows` (any order)."""
    episodes = _episodes_in_order(rows)
    rewards = combine_rewards(
        [[s.process_reward for s in steps] for steps in episodes],
        [[s.outcome_reward for s in steps] for steps in episodes],
        process_weight=process_weight,
        normalize=process_norm,
    )
    layout = build_episode_layout(
        [
            [EpisodeStep(list(s.prompt_ids), list(s.response_ids), r) for s, r in zip(steps, step_rewards)]
            for steps, step_rewards in zip(episodes, rewards)
        ]
    )
    group_numbers = {name: i for i, name in enumerate(dict.fromkeys(steps[0].group_id for steps in episodes))}
    group_index = torch.tensor([group_numbers[steps[0].group_id] for steps in episodes], dtype=torch.long)
    return EpisodeBatch(
        layout=layout,
        group_index=group_index,
        episode_ids=tuple(steps[0].episode_id for steps in episodes),
        episode_steps=tuple(tuple(steps) for steps in episodes),
    )


def _resolve_grid(name: str, source: GridSource, layout: EpisodeLayout) -> torch.Tensor | None:
    grid = source(layout) if callable(source) else source
    if grid is not None and tuple(grid.shape) != tuple(layout.token_rewards.shape):
        raise ValueError(f"{name} shape {tuple(grid.shape)} != episode grid shape {tuple(layout.token_rewards.shape)}")
    return grid


def estimate_step_advantages(
    batch: EpisodeBatch,
    *,
    estimator: str,
    gamma: float,
    lam: float,
    eps: float,
    norm_by_std: bool,
    use_advantage_mask: bool,
    values: GridSource = None,
    kl_penalty: GridSource = None,
) -> list[StepAdvantage]:
    """Run `estimator` on `batch` and split the result per step (episode order, then step order).

    values: critic values [E, T] on the batch's grid, or a function of the layout returning them
    (for gae / step_gae). kl_penalty: [E, T] (or a function of the layout), e.g. beta * KL
    estimate per token, subtracted from the rewards on action tokens only (other entries are
    ignored).
    """
    layout = batch.layout
    value_grid = _resolve_grid("values", values, layout)
    penalty_grid = _resolve_grid("kl_penalty", kl_penalty, layout)
    token_rewards = layout.token_rewards
    if penalty_grid is not None:
        token_rewards = token_rewards - penalty_grid.to(torch.float32) * layout.action_mask.to(torch.float32)
    output = compute_advantages(
        estimator, token_rewards, advantage_mask(layout, use_advantage_mask), batch.group_index, value_grid,
        gamma=gamma, lam=lam, eps=eps, norm_by_std=norm_by_std, step_starts=layout.step_starts,
    )
    advantages, returns = unpack(output.advantages, layout), unpack(output.returns, layout)
    critic = unpack(value_grid, layout) if value_grid is not None else None
    results = []
    for e, steps in enumerate(batch.episode_steps):
        for k, step in enumerate(steps):
            has_observation = not use_advantage_mask and bool(advantages[e][k].observation)
            results.append(
                StepAdvantage(
                    episode_id=step.episode_id,
                    step_idx=step.step_idx,
                    advantages=advantages[e][k].response,
                    returns=returns[e][k].response,
                    values=critic[e][k].response if critic is not None else None,
                    obs_advantages=advantages[e][k].observation if has_observation else None,
                    obs_returns=returns[e][k].observation if has_observation else None,
                    obs_values=critic[e][k].observation if has_observation and critic is not None else None,
                )
            )
    return results


def advantages_for_steps(
    rows: Sequence[StepRewardRow],
    *,
    estimator: str,
    gamma: float,
    lam: float,
    eps: float,
    norm_by_std: bool,
    use_advantage_mask: bool,
    process_weight: float,
    process_norm: str,
    values: GridSource = None,
    kl_penalty: GridSource = None,
) -> list[StepAdvantage]:
    """``prepare_episodes`` then ``estimate_step_advantages`` (values / kl_penalty as functions
    of the layout, since the grid is built inside)."""
    batch = prepare_episodes(rows, process_weight=process_weight, process_norm=process_norm)
    return estimate_step_advantages(
        batch, estimator=estimator, gamma=gamma, lam=lam, eps=eps, norm_by_std=norm_by_std,
        use_advantage_mask=use_advantage_mask, values=values, kl_penalty=kl_penalty,
    )
