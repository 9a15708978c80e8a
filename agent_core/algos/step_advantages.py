"""From per-step rewards to per-token advantages of each step (the compute_advantages stage).

Two calls, so a caller can run a critic or reference model between them: ``prepare_episodes(rows)`` builds the
episodes, groups and token grid with each step's combined reward; ``estimate_step_advantages(batch, ...)``
runs the estimator under the advantage mask and splits the result back into one record per step. With a mask
off, observation tokens also get stored values (``obs_advantages``, ...; docs/architecture.md §3).
Design notes: docs/architecture.md §11 (agent_core/algos/step_advantages.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from agent_core.algos.estimator_core import AdvantageInputs, estimate_advantages
from agent_core.algos.episodes import EpisodeLayout, EpisodeStep, advantage_mask, build_episode_layout, unpack
from agent_core.episodes import episodes_from_rows

GridSource = Union[torch.Tensor, Callable[[EpisodeLayout], torch.Tensor], None]


@dataclass(frozen=True)
class StepRewardRow:
    """One step of the steps table joined with its rewards row (reward: the combined reward; anchor:
    the key of the env state the step started from, None when the env gave none; read by gigpo)."""

    episode_id: str
    group_id: str
    step_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    anchor: str | None = None


@dataclass(frozen=True)
class StepAdvantage:
    """Per-token results of one step. advantages, returns, values align with its response_ids;
    obs_* with the observation tokens after the response, set only when the step has observation
    tokens in the grid and a mask is off: obs_advantages when either is, obs_returns and
    obs_values when the advantage mask is (module docstring); None otherwise. values and
    obs_values are None without a critic."""

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


def prepare_episodes(rows: Sequence[StepRewardRow]) -> EpisodeBatch:
    """Episodes, groups and the token grid of `rows` (any order)."""
    episodes = episodes_from_rows(rows)
    layout = build_episode_layout(
        [[EpisodeStep(list(s.prompt_ids), list(s.response_ids), s.reward) for s in episode.steps] for episode in episodes]
    )
    group_numbers = {name: i for i, name in enumerate(dict.fromkeys(episode.group_id for episode in episodes))}
    group_index = torch.tensor([group_numbers[episode.group_id] for episode in episodes], dtype=torch.long)
    return EpisodeBatch(
        layout=layout,
        group_index=group_index,
        episode_ids=tuple(episode.episode_id for episode in episodes),
        episode_steps=tuple(episode.steps for episode in episodes),
    )


def _resolve_grid(name: str, source: GridSource, layout: EpisodeLayout) -> torch.Tensor | None:
    grid = source(layout) if callable(source) else source
    if grid is not None and tuple(grid.shape) != tuple(layout.token_rewards.shape):
        raise ValueError(f"{name} shape {tuple(grid.shape)} != episode grid shape {tuple(layout.token_rewards.shape)}")
    return grid


def anchor_grid(batch: EpisodeBatch) -> torch.Tensor:
    """int64 [E, T]: at each step's first action token an id of its anchor (equal strings, equal ids;
    the estimator scopes them to a prompt group), -1 for a step without one and everywhere else."""
    grid = torch.full(batch.layout.token_rewards.shape, -1, dtype=torch.long)
    ids: dict[str, int] = {}
    for e, steps in enumerate(batch.episode_steps):
        for step, span in zip(steps, batch.layout.step_spans[e]):
            if step.anchor is not None and span.response_end > span.start:
                grid[e, span.start] = ids.setdefault(step.anchor, len(ids))
    return grid


def carry_into_observations(values: torch.Tensor, action_mask: torch.Tensor, real_mask: torch.Tensor) -> torch.Tensor:
    """[E, T] -> [E, T]: action tokens keep their value; every other real token takes the value of
    the last action token before it in its row (0 when there is none); padding 0."""
    positions = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    last_action = torch.where(action_mask.to(torch.bool), positions, -1).cummax(dim=-1).values
    carried = values.gather(-1, last_action.clamp(min=0))
    return torch.where(real_mask.to(torch.bool) & (last_action >= 0), carried, torch.zeros_like(carried))


def _step_records(batch: EpisodeBatch, advantages, returns, critic, *, observation_advantages: bool,
                  observation_targets: bool) -> list[StepAdvantage]:
    """One StepAdvantage per step from unpacked grids; obs_advantages only if observation_advantages,
    obs_returns / obs_values only if observation_targets too (module docstring)."""
    results = []
    for e, steps in enumerate(batch.episode_steps):
        for k, step in enumerate(steps):
            has_observation = observation_advantages and bool(advantages[e][k].observation)
            targets = has_observation and observation_targets
            results.append(
                StepAdvantage(
                    episode_id=step.episode_id,
                    step_idx=step.step_idx,
                    advantages=advantages[e][k].response,
                    returns=returns[e][k].response,
                    values=critic[e][k].response if critic is not None else None,
                    obs_advantages=advantages[e][k].observation if has_observation else None,
                    obs_returns=returns[e][k].observation if targets else None,
                    obs_values=critic[e][k].observation if targets and critic is not None else None,
                )
            )
    return results


def estimate_step_advantages(
    batch: EpisodeBatch,
    *,
    estimator: str,
    gamma: float,
    lam: float,
    eps: float,
    norm_by_std: bool,
    use_advantage_mask: bool,
    use_loss_mask: bool = True,
    whiten: bool = False,
    omega: float = 1.0,
    options: Any = None,
    values: GridSource = None,
    kl_penalty: GridSource = None,
) -> list[StepAdvantage]:
    """Run `estimator` on `batch` and split the result per step (episode order, then step order).

    values: critic values [E, T] on the batch's grid (``score_on_grid``), or a function of the
    layout returning them (for gae / step_gae). kl_penalty: [E, T] (or a function of the layout),
    e.g. beta * KL estimate per token, subtracted from the rewards on action tokens only (other
    entries are ignored). use_loss_mask: False stores observation advantages for the policy to
    train with (module docstring). whiten: passed to the estimator (gae, step_gae); omega: the step-level
    weight (gigpo, which also reads the rows' anchors); options: the estimator's own settings object
    (``AdvantageInputs.options``).
    """
    layout = batch.layout
    value_grid = _resolve_grid("values", values, layout)
    penalty_grid = _resolve_grid("kl_penalty", kl_penalty, layout)
    token_rewards = layout.token_rewards
    if penalty_grid is not None:
        token_rewards = token_rewards - penalty_grid.to(torch.float32) * layout.action_mask.to(torch.float32)
    output = estimate_advantages(estimator, AdvantageInputs(
        token_rewards, advantage_mask(layout, use_advantage_mask), batch.group_index, value_grid,
        gamma=gamma, lam=lam, eps=eps, norm_by_std=norm_by_std, step_starts=layout.step_starts, whiten=whiten,
        step_anchors=anchor_grid(batch), omega=omega, options=options,
    ))
    advantage_grid = output.advantages
    if use_advantage_mask and not use_loss_mask:
        advantage_grid = carry_into_observations(advantage_grid, layout.action_mask, layout.real_mask)
    return _step_records(
        batch, unpack(advantage_grid, layout), unpack(output.returns, layout),
        unpack(value_grid, layout) if value_grid is not None else None,
        observation_advantages=not (use_advantage_mask and use_loss_mask), observation_targets=not use_advantage_mask,
    )


def score_on_grid(batch: EpisodeBatch, score: Callable[[list[list[int]]], list[list[float]]]) -> torch.Tensor:
    """A model's per-token outputs (a critic's values) on the batch's grid, float32 [E, T], each
    column scored in the very context its token was generated in (docs/architecture.md §2).

    score(contexts) returns, per context, one float per token (position t: the output for token
    t given the tokens before it, as ``agent_core.training.critic.score_values``).
    An append-only episode is scored once, on its row (``layout.row_context``): every step's
    context is a prefix of it, and its observation columns get outputs too. Any other episode
    (e.g. a last_k window) is scored once per step, on that step's own prompt + response, since
    the concatenated responses of its row are a context the policy never saw.
    """
    layout = batch.layout
    jobs = []  # (episode, first column, end column, context, position of the first column in it)
    for e, steps in enumerate(batch.episode_steps):
        if layout.append_only[e]:
            start = len(layout.first_prompt_ids[e])  # the row IS the context: column t = position t
            jobs.append((e, start, layout.row_length(e), layout.row_context(e), start))
            continue
        for step, span in zip(steps, layout.step_spans[e]):
            if span.response_end > span.start:
                context = [int(t) for t in step.prompt_ids] + [int(t) for t in step.response_ids]
                jobs.append((e, span.start, span.response_end, context, len(step.prompt_ids)))
    scored = score([job[3] for job in jobs]) if jobs else []
    grid = torch.zeros(layout.token_rewards.shape, dtype=torch.float32)
    for (e, start, end, _, offset), outputs in zip(jobs, scored):
        grid[e, start:end] = torch.tensor(list(outputs[offset: offset + end - start]), dtype=torch.float32)
    return grid
