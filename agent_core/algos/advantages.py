"""Advantage estimators, registered by name, all with one signature (DESIGN.md §7).

Signature, shapes and the mask convention: ``agent_core.algos.estimator_core``. Importing this
module registers every built-in estimator:

- ``gae``, ``step_gae``: critic-based, in ``agent_core.algos.estimators_critic``;
- ``grpo``: group-normalized episode score (Shao et al. 2024, DeepSeekMath; with
  ``norm_by_std=False`` the Dr.GRPO variant of Liu et al. 2025);
- ``rloo``: leave-one-out baseline (Ahmadian et al. 2024);
- ``reinforce_pp``: discounted return-to-go, batch-whitened (REINFORCE++, Hu 2025,
  arXiv 2501.03262);
- ``reinforce_pp_baseline``: episode score minus its group mean, batch-whitened (REINFORCE++
  with a baseline, as in verl's ``reinforce_plus_plus_baseline``).

Outcome-style estimators (grpo, rloo, reinforce_pp_baseline) score an episode by the
undiscounted sum of its masked token rewards, so process rewards count towards the score.
"""

from __future__ import annotations

import torch

from agent_core.algos.estimator_core import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageOutput,
    GroupStats,
    broadcast_to_tokens,
    check_inputs,
    episode_scores,
    group_stats,
    ignores_advantage_mask,
    masked_whiten,
    zero_groups_of_one,
)
from agent_core.algos.estimators_critic import gae_advantages, step_gae_advantages  # registers them too

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageOutput",
    "GroupStats",
    "compute_advantages",
    "discounted_returns",
    "episode_scores",
    "gae_advantages",
    "grpo_advantages",
    "group_stats",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "step_gae_advantages",
]


def _output(advantages: torch.Tensor, returns: torch.Tensor) -> AdvantageOutput:
    return AdvantageOutput(advantages=advantages.to(torch.float32), returns=returns.to(torch.float32))


@ADVANTAGE_ESTIMATORS.register("grpo")
@ignores_advantage_mask
def grpo_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    step_starts: torch.Tensor | None = None,
    whiten: bool = False,
) -> AdvantageOutput:
    """GRPO outcome advantages (Shao et al. 2024), or Dr.GRPO's (Liu et al. 2025) when not norm_by_std.

    Shapes: token_rewards, mask [E, T]; group_index [E]; outputs [E, T].
    score_e = sum of episode e's masked token rewards (undiscounted; gamma, lam, values unused).
    advantage_e = (score_e - mean_g) / (std_g + eps) with norm_by_std, score_e - mean_g without,
    broadcast over the episode's masked tokens; returns = score_e broadcast.
    std_g is the unbiased (Bessel-corrected, n - 1) sample std of the group, as in the reference
    implementations (verl, TRL use torch.std). A group of one gets advantage 0 and a one-time
    GroupOfOneWarning (verl keeps its raw score instead; estimator_core says why not here).
    whiten is unused (the group normalization is the scaling).
    """
    check_inputs(token_rewards, mask, group_index, values, step_starts)
    scores = episode_scores(token_rewards, mask)
    stats = group_stats(scores, group_index)
    centered = scores - stats.mean
    advantage = centered / (stats.unbiased_std + eps) if norm_by_std else centered
    advantage = zero_groups_of_one("grpo", advantage, stats.count)
    return _output(broadcast_to_tokens(advantage, mask), broadcast_to_tokens(scores, mask))


@ADVANTAGE_ESTIMATORS.register("rloo")
@ignores_advantage_mask
def rloo_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    step_starts: torch.Tensor | None = None,
    whiten: bool = False,
) -> AdvantageOutput:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024).

    Shapes: token_rewards, mask [E, T]; group_index [E]; outputs [E, T].
    advantage_e = score_e - mean of the OTHER episodes' scores in its group, broadcast over
    the episode's masked tokens; returns = score_e broadcast. A group of one gets advantage 0 and
    a one-time GroupOfOneWarning (as grpo). RLOO does not scale by a std: norm_by_std, eps,
    gamma, lam, values and whiten are unused.
    """
    check_inputs(token_rewards, mask, group_index, values, step_starts)
    scores = episode_scores(token_rewards, mask)
    stats = group_stats(scores, group_index)
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
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    step_starts: torch.Tensor | None = None,
    whiten: bool = False,
) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): token-level discounted return-to-go, whitened
    over every masked token of the batch (as verl / OpenRLHF do).

    Shapes: token_rewards, mask [E, T]; group_index [E] (unused); outputs [E, T].
    returns = G_t (``discounted_returns``); advantages = (G_t - mean) / (std + eps), mean and
    unbiased std over all masked tokens of the batch. lam, values, norm_by_std are unused; whiten
    too (the whitening is part of REINFORCE++, always on).
    """
    check_inputs(token_rewards, mask, group_index, values, step_starts)
    returns = discounted_returns(token_rewards, mask, gamma)
    return _output(masked_whiten(returns, mask, eps), returns)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    step_starts: torch.Tensor | None = None,
    whiten: bool = False,
) -> AdvantageOutput:
    """REINFORCE++ with a group baseline (verl's ``reinforce_plus_plus_baseline``).

    Shapes: token_rewards, mask [E, T]; group_index [E]; outputs [E, T].
    centred_e = score_e - mean_g (score = undiscounted sum of masked token rewards), broadcast
    to the episode's masked tokens, then whitened over all masked tokens of the batch (mean and
    unbiased std, + eps). A group of one keeps its raw score (baseline 0, as in verl): the batch
    whitening is then its baseline. returns = score_e broadcast. gamma, lam, values, norm_by_std
    and whiten are unused (the whitening is part of the algorithm, always on).
    """
    check_inputs(token_rewards, mask, group_index, values, step_starts)
    scores = episode_scores(token_rewards, mask)
    stats = group_stats(scores, group_index)
    centred = torch.where(stats.count > 1, scores - stats.mean, scores)
    advantages = masked_whiten(broadcast_to_tokens(centred, mask), mask, eps)
    return _output(advantages, broadcast_to_tokens(scores, mask))


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    step_starts: torch.Tensor | None = None,
    whiten: bool = False,
) -> AdvantageOutput:
    """Run the estimator registered as `name` (UnknownNameError lists the valid names)."""
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    return estimator(
        token_rewards, mask, group_index, values,
        gamma=gamma, lam=lam, eps=eps, norm_by_std=norm_by_std, step_starts=step_starts, whiten=whiten,
    )
