"""GiGPO: group-in-group advantages over anchor states (Feng et al. 2025, arXiv 2505.10978).

A step's advantage is A = A^E + omega * A^S: its episode's advantage (exactly our ``grpo``) plus its
discounted return G_t normalised within its anchor group (the steps of its group that met the same state).
Unlike the paper's code (verl-agent): anchors are env keys (``EnvStep.anchor``) matched exactly, each episode
counts once in its group's statistics, and a step with no anchor gets step advantage 0 (no anchors: grpo).
Design notes: docs/architecture.md §11 (agent_core/algos/gigpo.py).
"""

from __future__ import annotations

import torch

from agent_core.algos.estimator_core import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutput,
    episode_scores,
    group_stats,
    step_index,
    zero_groups_of_one,
)


def step_returns(rewards: torch.Tensor, on: torch.Tensor, step: torch.Tensor, gamma: float) -> torch.Tensor:
    """G[e, k] = R[e, k] + gamma * G[e, k+1], R the masked rewards of step k's columns, float64 [E, K]
    (steps a row does not have hold 0 and add nothing)."""
    num_steps = max(int(step.max().item()) + 1, 1) if step.numel() else 1
    masked = torch.where(on & (step >= 0), rewards.to(torch.float64), 0.0)
    per_step = torch.zeros(rewards.shape[0], num_steps, dtype=torch.float64, device=rewards.device)
    per_step = per_step.scatter_add(1, step.clamp(min=0), masked)
    returns = torch.zeros_like(per_step)
    following = torch.zeros(rewards.shape[0], dtype=torch.float64, device=rewards.device)
    for k in reversed(range(num_steps)):
        following = per_step[:, k] + gamma * following
        returns[:, k] = following
    return returns


def anchor_group_advantages(returns: torch.Tensor, anchors: torch.Tensor, group_index: torch.Tensor,
                            eps: float, norm_by_std: bool) -> torch.Tensor:
    """A^S [E, K]: returns [E, K] minus the mean of their anchor group (steps sharing the episode's
    group_index and a non-negative anchor id), divided by the group's unbiased std + eps when
    norm_by_std; 0 for singleton groups and unanchored (negative id) steps."""
    anchored = anchors >= 0
    if not bool(anchored.any()):
        return torch.zeros_like(returns)
    keys = torch.stack([group_index[:, None].expand_as(anchors)[anchored], anchors[anchored]], dim=1)
    _, dense = torch.unique(keys, dim=0, return_inverse=True)
    values = returns[anchored]
    stats = group_stats(values, dense)
    centred = values - stats.mean
    scaled = centred / (stats.unbiased_std + eps) if norm_by_std else centred
    out = torch.zeros_like(returns)
    out[anchored] = torch.where(stats.count > 1, scaled, torch.zeros_like(scaled))
    return out


@ADVANTAGE_ESTIMATORS.register("gigpo")
def gigpo_advantages(inputs: AdvantageInputs) -> AdvantageOutput:
    """GiGPO (module docstring): A = A^E + omega * A^S on each step's masked tokens.

    Reads token_rewards, mask, step_starts, step_anchors [E, T], group_index [E], gamma, eps,
    norm_by_std, omega; outputs [E, T]. A^E: grpo's advantage of the episode (undiscounted score,
    group mean and unbiased std). A^S: the step's discounted return (per step, gamma) normalised
    within its anchor group (``anchor_group_advantages``); step k's value covers the masked
    columns from its step start up to the next one. returns = the step's discounted return there.
    ValueError when step_starts or step_anchors is None. whiten and lam are not read.
    """
    if inputs.step_anchors is None:
        raise ValueError("advantage estimator 'gigpo' needs step_anchors [E, T] (each step's anchor-state id at its "
                         "step start; -1 for none): build inputs with agent_core.algos.step_advantages")
    on = inputs.mask.to(torch.bool)
    step = step_index(on, inputs.step_starts, "gigpo")
    index = step.clamp(min=0)
    scores = episode_scores(inputs.token_rewards, inputs.mask)
    stats = group_stats(scores, inputs.group_index)
    centred = scores - stats.mean
    episode = centred / (stats.unbiased_std + inputs.eps) if inputs.norm_by_std else centred
    episode = zero_groups_of_one("gigpo", episode, stats.count)

    returns = step_returns(inputs.token_rewards, on, step, inputs.gamma)
    starts = inputs.step_starts.to(torch.bool)
    anchors = _anchors_per_step(starts, index, inputs.step_anchors, returns.shape[1])
    step_advantage = anchor_group_advantages(returns, anchors, inputs.group_index.to(torch.long), inputs.eps,
                                             inputs.norm_by_std)
    in_step = on & (step >= 0)
    advantages = episode[:, None] + inputs.omega * step_advantage.gather(1, index)
    advantages = torch.where(in_step, advantages, 0.0)
    token_returns = torch.where(in_step, returns.gather(1, index), 0.0)
    return AdvantageOutput(advantages=advantages.to(torch.float32), returns=token_returns.to(torch.float32))


def _anchors_per_step(starts: torch.Tensor, index: torch.Tensor, step_anchors: torch.Tensor,
                      num_steps: int) -> torch.Tensor:
    """[E, K] int64: the anchor id at step k's start column (-1 for steps a row does not have)."""
    anchors = torch.full((starts.shape[0], num_steps), -1, dtype=torch.long, device=starts.device)
    rows, columns = starts.nonzero(as_tuple=True)
    anchors[rows, index[rows, columns]] = step_anchors.to(torch.long)[rows, columns]
    return anchors
