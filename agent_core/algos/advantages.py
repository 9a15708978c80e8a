"""Advantage estimators, registered by name, all with one signature (DESIGN.md §7).

Every estimator is called as::

    fn(token_rewards, mask, group_index, values=None, *, gamma=1.0, lam=1.0, eps=1e-6,
       norm_by_std=True) -> AdvantageOutput

on the episode token layout of ``agent_core.algos.episodes``:

- token_rewards: float [E, T], each step's reward on its last token (plus any in-reward KL
  penalty a caller folds in per token);
- mask: float [E, T], 1 on the episode's tokens (the advantage mask), 0 on padding;
- group_index: int64 [E], episodes with the same value were sampled from the same prompt
  (any integers; they need not be contiguous);
- values: float [E, T] critic values, for estimators that use a critic (None otherwise).

Parameters an estimator has no use for are accepted and ignored, so a config can switch
estimators by name alone. Outputs are zero wherever ``mask`` is 0.

Built here: ``grpo`` (Shao et al. 2024, DeepSeekMath; with ``norm_by_std=False`` the Dr.GRPO
variant of Liu et al. 2025) and ``rloo`` (Ahmadian et al. 2024). Token-level GAE, per-step GAE
and REINFORCE++ plug into the same registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from agent_core.registry import Registry


@dataclass(frozen=True)
class AdvantageOutput:
    """advantages, returns: float32 [E, T], zero where the mask is 0."""

    advantages: torch.Tensor
    returns: torch.Tensor


class AdvantageEstimator(Protocol):
    def __call__(
        self,
        token_rewards: torch.Tensor,
        mask: torch.Tensor,
        group_index: torch.Tensor,
        values: torch.Tensor | None = None,
        *,
        gamma: float = 1.0,
        lam: float = 1.0,
        eps: float = 1e-6,
        norm_by_std: bool = True,
    ) -> AdvantageOutput: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _check_inputs(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor, values: torch.Tensor | None
) -> None:
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be [E, T]; got shape {tuple(token_rewards.shape)}")
    if mask.shape != token_rewards.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != token_rewards shape {tuple(token_rewards.shape)}")
    if values is not None and values.shape != token_rewards.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != token_rewards shape {tuple(token_rewards.shape)}")
    if group_index.dim() != 1 or group_index.shape[0] != token_rewards.shape[0]:
        raise ValueError(
            f"group_index must be [E] with E = {token_rewards.shape[0]} episodes; got {tuple(group_index.shape)}"
        )
    if group_index.dtype.is_floating_point:
        raise ValueError(f"group_index must be an integer tensor; got {group_index.dtype}")


def episode_scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The undiscounted return of each episode: sum of its masked token rewards, float64 [E]."""
    return (token_rewards.to(torch.float64) * mask.to(torch.float64)).sum(dim=-1)


@dataclass(frozen=True)
class GroupStats:
    """Per-episode statistics of the episode's group, float64 [E] each (count as float)."""

    count: torch.Tensor
    total: torch.Tensor
    mean: torch.Tensor
    unbiased_std: torch.Tensor


def group_stats(scores: torch.Tensor, group_index: torch.Tensor) -> GroupStats:
    """Group count, sum, mean and unbiased std of `scores` [E], gathered back to each episode.

    The std of a group of one is reported as 0 (the unbiased estimate is undefined there).
    """
    _, dense = torch.unique(group_index, return_inverse=True)
    num_groups = int(dense.max().item()) + 1 if dense.numel() else 0
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
    count = zeros.index_add(0, dense, torch.ones_like(scores))
    total = zeros.index_add(0, dense, scores)
    mean = total / count
    squared = zeros.index_add(0, dense, (scores - mean[dense]) ** 2)
    var = torch.where(count > 1, squared / (count - 1).clamp(min=1), torch.zeros_like(squared))
    return GroupStats(count=count[dense], total=total[dense], mean=mean[dense], unbiased_std=var.sqrt()[dense])


def _broadcast(per_episode: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[E] -> [E, T] float32, zero off the mask."""
    return (per_episode[:, None] * mask.to(torch.float64)).to(torch.float32)


@ADVANTAGE_ESTIMATORS.register("grpo")
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
) -> AdvantageOutput:
    """GRPO outcome advantages (Shao et al. 2024), or Dr.GRPO's (Liu et al. 2025) when not norm_by_std.

    Shapes: token_rewards, mask [E, T]; group_index [E]; outputs [E, T].
    score_e = sum of episode e's token rewards (undiscounted; gamma, lam, values are unused).
    advantage_e = (score_e - mean_g) / (std_g + eps) with norm_by_std, score_e - mean_g without,
    broadcast over the episode's masked tokens; returns = score_e broadcast.
    std_g is the unbiased (Bessel-corrected, n - 1) sample std of the group, as in the reference
    implementations (verl, TRL use torch.std); a group of one gets advantage 0.
    """
    _check_inputs(token_rewards, mask, group_index, values)
    scores = episode_scores(token_rewards, mask)
    stats = group_stats(scores, group_index)
    centered = scores - stats.mean
    advantage = centered / (stats.unbiased_std + eps) if norm_by_std else centered
    advantage = torch.where(stats.count > 1, advantage, torch.zeros_like(advantage))
    return AdvantageOutput(advantages=_broadcast(advantage, mask), returns=_broadcast(scores, mask))


@ADVANTAGE_ESTIMATORS.register("rloo")
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
) -> AdvantageOutput:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024).

    Shapes: token_rewards, mask [E, T]; group_index [E]; outputs [E, T].
    advantage_e = score_e - mean of the OTHER episodes' scores in its group, broadcast over
    the episode's masked tokens; returns = score_e broadcast. A group of one gets advantage 0.
    RLOO does not scale by a std: norm_by_std, eps, gamma, lam and values are unused.
    """
    _check_inputs(token_rewards, mask, group_index, values)
    scores = episode_scores(token_rewards, mask)
    stats = group_stats(scores, group_index)
    others = (stats.count - 1).clamp(min=1)
    baseline = (stats.total - scores) / others
    advantage = torch.where(stats.count > 1, scores - baseline, torch.zeros_like(scores))
    return AdvantageOutput(advantages=_broadcast(advantage, mask), returns=_broadcast(scores, mask))


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
) -> AdvantageOutput:
    """Run the estimator registered as `name` (UnknownNameError lists the valid names)."""
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    return estimator(
        token_rewards, mask, group_index, values, gamma=gamma, lam=lam, eps=eps, norm_by_std=norm_by_std
    )
