"""GiGPO: group-in-group advantages over anchor states (Feng et al. 2025, arXiv 2505.10978).

What the paper does. GRPO's group of episodes sampled from one prompt gives the episode-level
("macro") advantage A^E(tau) = (R(tau) - mean) / F_norm over the group (F_norm = the std, or 1).
Inside that group, every step is keyed by the environment state it acted in; steps of DIFFERENT
episodes (at any time step) that met an identical state form an "anchor state" group. Each step's
discounted return G_t = sum_k gamma^k r_{t+k} is normalised within its anchor group, giving the
step-level ("micro") advantage A^S = (G_t - mean) / F_norm. The policy is trained with
A = A^E + omega * A^S on the step's action tokens (the paper's gamma 0.95, omega 1). A state
visited once in the group (a singleton) has no comparison: its step advantage is 0.

What the anchor's code does. The AgentR1/Agent-R1 snapshot read for this (main and v0.1.0) has no
GiGPO code: its ``core_algos.py`` holds GAE, token-level GAE and GRPO only. The paper's own
implementation (verl-agent, ``gigpo/core_gigpo.py``) was read instead: one batch row per step; the
anchor of a row is the env's raw current observation (exact match, or optionally a text-similarity
threshold), grouped within the prompt group's index; discounted returns are computed per step
over each trajectory; both levels use torch.std (unbiased) with mode ``mean_norm`` (no std) by
default; the sum is broadcast over the row's response tokens.

Where we differ, and why:
- episode level: exactly our ``grpo`` (each episode counted once in its group's mean and std, a
  group of one gets 0 and a warning). verl-agent by default computes the group's statistics over
  step rows, so an episode weighs by its number of steps, and a group of one keeps its raw score;
- normalisation follows ``norm_by_std`` at both levels (true by default, the paper's F_norm = std);
  ``norm_by_std: false`` is verl-agent's default ``mean_norm``;
- anchors are keys the env gives (``EnvStep.anchor``; the search env: the set of retrieved
  document ids), matched exactly, no similarity clustering: two different queries that retrieve
  the same documents lead to the same state, while raw texts differing in a query echo would not;
- a step with no anchor (an env that gives none, or a table written before the column) is a
  singleton: step advantage 0. With no anchors at all, gigpo is grpo.
- ``returns`` is each step's discounted return G_t (no critic reads it; grpo stores the score).
- the advantage mask: rewards sit on action tokens, so, as for grpo, action-token advantages are
  the same with it off; observation tokens then get their step's value (a step's columns run up
  to the next step start).

Input: ``AdvantageInputs`` with step_starts and step_anchors (``agent_core.algos.step_advantages``
builds both from the steps table's ``anchor`` column: the anchor of the state each step STARTS
from, the prompt for step 0).
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
