"""Outcome / Monte-Carlo advantage estimators, registered by name, each ``fn(inputs) -> output``.

``grpo`` (Dr.GRPO with ``norm_by_std=False``), ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``. Inputs,
outputs: ``agent_core.algos.estimator_core``; ``gae`` / ``step_gae``: ``agent_core.algos.estimators_critic``.
Differs from the papers: grpo, rloo and reinforce_pp_baseline score an episode by the undiscounted sum of its
masked token rewards (process rewards count); a group of one gets advantage 0 under grpo / rloo.
Design notes: docs/architecture.md §11 (agent_core/algos/advantages.py).
"""

from __future__ import annotations

import torch

from agent_core.algos.estimator_core import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageOutput,
    GroupStats,
    broadcast_to_tokens,
    episode_scores,
    group_stats,
    ignores_advantage_mask,
    masked_whiten,
    zero_groups_of_one,
)

# Names from estimator_core are re-exported for existing importers (agent_core.config reads
# ADVANTAGE_ESTIMATORS from here); the dispatcher and the input live in estimator_core only.
__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageOutput",
    "GroupStats",
    "discounted_returns",
    "episode_scores",
    "grpo_advantages",
    "group_stats",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]


def _output(advantages: torch.Tensor, returns: torch.Tensor) -> AdvantageOutput:
    return AdvantageOutput(advantages=advantages.to(torch.float32), returns=returns.to(torch.float32))


@ADVANTAGE_ESTIMATORS.register("grpo")
@ignores_advantage_mask
def grpo_advantages(inputs: AdvantageInputs) -> AdvantageOutput:
    """GRPO outcome advantages (Shao et al. 2024), or Dr.GRPO's (Liu et al. 2025) when not norm_by_std.

    Reads token_rewards, mask [E, T], group_index [E], eps, norm_by_std; outputs [E, T].
    score_e = sum of episode e's masked token rewards (undiscounted).
    advantage_e = (score_e - mean_g) / (std_g + eps) with norm_by_std, score_e - mean_g without,
    broadcast over the episode's masked tokens; returns = score_e broadcast.
    std_g is the unbiased (Bessel-corrected, n - 1) sample std of the group, as in the reference
    implementations (verl, TRL use torch.std). A group of one gets advantage 0 and a one-time
    GroupOfOneWarning (verl keeps its raw score instead; estimator_core says why not here).
    whiten is not read (the group normalization is the scaling).
    """
    mask = inputs.mask
    scores = episode_scores(inputs.token_rewards, mask)
    stats = group_stats(scores, inputs.group_index)
    centered = scores - stats.mean
    advantage = centered / (stats.unbiased_std + inputs.eps) if inputs.norm_by_std else centered
    advantage = zero_groups_of_one("grpo", advantage, stats.count)
    return _output(broadcast_to_tokens(advantage, mask), broadcast_to_tokens(scores, mask))


@ADVANTAGE_ESTIMATORS.register("rloo")
@ignores_advantage_mask
def rloo_advantages(inputs: AdvantageInputs) -> AdvantageOutput:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024).

    Reads token_rewards, mask [E, T], group_index [E]; outputs [E, T].
    advantage_e = score_e - mean of the OTHER episodes' scores in its group, broadcast over
    the episode's masked tokens; returns = score_e broadcast. A group of one gets advantage 0 and
    a one-time GroupOfOneWarning (as grpo). RLOO does not scale by a std, so eps and norm_by_std
    are not read.
    """
    mask = inputs.mask
    scores = episode_scores(inputs.token_rewards, mask)
    stats = group_stats(scores, inputs.group_index)
    others = (stats.count - 1).clamp(min=1)
    baseline = (stats.total - scores) / others
    advantage = zero_groups_of_one("rloo", scores - baseline, stats.count)
    return _output(broadcast_to_tokens(advantage, mask), broadcast_to_tokens(scores, mask))


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over the masked tokens of each row: G_t = r_t + gamma * G_t' (t' the next
    masked token, G = 0 after the last), float64 [E, T], zero off the mask."""
    on = mask.to(torch.bool)
    rewards = torch.where(on, token_rewards.to(torch.float64), 0.0)
    returns = torch.zeros_like(rewards)
    next_return = torch.zeros(rewards.shape[0], dtype=torch.float64, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        current = rewards[:, t] + gamma * next_return
        returns[:, t] = torch.where(on[:, t], current, 0.0)
        next_return = torch.where(on[:, t], current, next_return)
    return returns


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(inputs: AdvantageInputs) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): token-level discounted return-to-go, whitened
    over every masked token of the batch (as verl / OpenRLHF do).

    Reads token_rewards, mask [E, T], gamma, eps; outputs [E, T].
    returns = G_t (``discounted_returns``); advantages = (G_t - mean) / (std + eps), mean and
    unbiased std over all masked tokens of the batch. whiten is not read (the whitening is part of
    REINFORCE++, always on).
    """
    returns = discounted_returns(inputs.token_rewards, inputs.mask, inputs.gamma)
    return _output(masked_whiten(returns, inputs.mask, inputs.eps), returns)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(inputs: AdvantageInputs) -> AdvantageOutput:
    """REINFORCE++ with a group baseline (verl's ``reinforce_plus_plus_baseline``).

    Reads token_rewards, mask [E, T], group_index [E], eps; outputs [E, T].
    centred_e = score_e - mean_g (score = undiscounted sum of masked token rewards), broadcast
    to the episode's masked tokens, then whitened over all masked tokens of the batch (mean and
    unbiased std, + eps). A group of one keeps its raw score (baseline 0, as in verl): the batch
    whitening is then its baseline. returns = score_e broadcast. whiten is not read (the
    whitening is part of the algorithm, always on).
    """
    mask = inputs.mask
    scores = episode_scores(inputs.token_rewards, mask)
    stats = group_stats(scores, inputs.group_index)
    centred = torch.where(stats.count > 1, scores - stats.mean, scores)
    advantages = masked_whiten(broadcast_to_tokens(centred, mask), mask, inputs.eps)
    return _output(advantages, broadcast_to_tokens(scores, mask))
