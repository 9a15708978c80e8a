"""What every advantage estimator shares: the registry, the input, the output, the dispatcher
and the masked helpers (episode scores, group statistics, batch whitening).

Every estimator is ``fn(inputs: AdvantageInputs) -> AdvantageOutput``; outputs are float32 [E, T], zero where
``mask`` is 0. This base module imports nothing of ``agent_core.algos``; the package's ``__init__`` registers
every built-in estimator. Differs from verl: a group of one (``grpo``, ``rloo``) gets advantage 0, no score.
Design notes: docs/architecture.md §11 (agent_core/algos/estimator_core.py).
"""

from __future__ import annotations

import warnings
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

import torch

from agent_core.registry import Registry


@dataclass(frozen=True)
class AdvantageOutput:
    """advantages, returns: float32 [E, T], zero where the mask is 0."""

    advantages: torch.Tensor
    returns: torch.Tensor


# eq=False: a generated __eq__ would compare tensors, whose truth value is ambiguous.
@dataclass(frozen=True, eq=False)
class AdvantageInputs:
    """What an estimator reads, on the episode token grid of ``agent_core.algos.episodes``
    (E episodes, T columns); shapes and dtypes are checked once, on construction (ValueError
    naming the offending field).

    - token_rewards: float [E, T], each step's reward on its last action token (minus any
      in-reward KL penalty the caller folds in per token);
    - mask: [E, T] 0/1 (any dtype), the ADVANTAGE mask: the tokens the recursion runs over.
      Action tokens only when the mask is on; every real token (actions and observations) when it
      is off. Rewards and values off the mask are ignored;
    - group_index: int [E], episodes with the same value were sampled from the same prompt (any
      integers; they need not be contiguous);
    - values: float [E, T] critic values, for estimators that use a critic (None otherwise);
    - step_starts: bool [E, T], True at the first action token of each step (``step_gae``, ``gigpo``);
    - step_anchors: int [E, T], at each step start the id of the ANCHOR STATE the step starts from
      (``gigpo`` only): steps of one prompt group with equal ids started from the same env state;
      a negative id means the step has no anchor; entries off the step starts are ignored;
    - gamma, lam: discount and GAE lambda (``gae``, ``step_gae``; gamma also ``reinforce_pp``);
    - eps: added to a std before dividing by it;
    - norm_by_std: ``grpo`` divides by the group std (False: Dr.GRPO, centring only);
    - whiten: whiten the advantages over every masked token of the batch (``gae``, ``step_gae``;
      ``reinforce_pp*`` always whiten as part of the algorithm, ``grpo`` / ``rloo`` never do).
    - omega: weight of the step-level (anchor-group) advantage added to the episode's (``gigpo``).
    - options: the estimator's own settings object (``algorithm.estimator_options`` validated by the
      settings model it was registered with: ``ADVANTAGE_ESTIMATORS.register(name, settings=...)``);
      None for one registered without.

    values is the last positional field; the rest are keyword-only.
    """

    token_rewards: torch.Tensor
    mask: torch.Tensor
    group_index: torch.Tensor
    values: torch.Tensor | None = None
    _: KW_ONLY
    step_starts: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    eps: float = 1e-6
    norm_by_std: bool = True
    whiten: bool = False
    step_anchors: torch.Tensor | None = None
    omega: float = 1.0
    options: Any = None

    def __post_init__(self) -> None:
        if self.token_rewards.dim() != 2:
            raise ValueError(f"token_rewards must be [E, T]; got shape {tuple(self.token_rewards.shape)}")
        shape = tuple(self.token_rewards.shape)
        for name in ("mask", "values", "step_starts", "step_anchors"):
            grid = getattr(self, name)
            if grid is not None and tuple(grid.shape) != shape:
                raise ValueError(f"{name} shape {tuple(grid.shape)} != token_rewards shape {shape}")
        group_index = self.group_index
        if group_index.dim() != 1 or group_index.shape[0] != shape[0]:
            raise ValueError(
                f"group_index must be [E] with E = {shape[0]} episodes; got {tuple(group_index.shape)}"
            )
        if group_index.dtype.is_floating_point:
            raise ValueError(f"group_index must be an integer tensor; got {group_index.dtype}")
        if self.step_anchors is not None and self.step_anchors.dtype.is_floating_point:
            raise ValueError(f"step_anchors must be an integer tensor; got {self.step_anchors.dtype}")


class AdvantageEstimator(Protocol):
    """An estimator: per-token advantages and returns (value targets) of `inputs`, float32 [E, T]
    each, zero off ``inputs.mask``. Its docstring names the fields of ``AdvantageInputs`` it reads."""

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutput: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def estimate_advantages(name: str, inputs: AdvantageInputs) -> AdvantageOutput:
    """Run the estimator registered as `name` on `inputs` (UnknownNameError lists the valid names)."""
    return ADVANTAGE_ESTIMATORS.get(name)(inputs)


def uses_critic(estimator: AdvantageEstimator) -> AdvantageEstimator:
    """Mark an estimator that needs critic values (the pipeline then trains a critic for it)."""
    estimator.uses_critic = True
    return estimator


def ignores_advantage_mask(estimator: AdvantageEstimator) -> AdvantageEstimator:
    """Mark an estimator whose action-token advantages cannot depend on the advantage mask (it
    only sums rewards, which sit on action tokens): a config refuses that ablation for it."""
    estimator.ignores_advantage_mask = True
    return estimator


# The built-in estimators are registered by the package's __init__, which has run before any
# caller could import this module, so a plain lookup sees them all.
def estimator_uses_critic(name: str) -> bool:
    return bool(getattr(ADVANTAGE_ESTIMATORS.get(name), "uses_critic", False))


def estimator_ignores_advantage_mask(name: str) -> bool:
    return bool(getattr(ADVANTAGE_ESTIMATORS.get(name), "ignores_advantage_mask", False))


class GroupOfOneWarning(UserWarning):
    """A group-baseline estimator met a group with a single episode (its advantage is 0)."""


_WARNED: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` the first time `key` is seen in this process, nothing after."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, category, stacklevel=3)


def zero_groups_of_one(name: str, advantage: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """`advantage` [E] with 0 for episodes alone in their group (count [E] = group sizes); warns
    once per estimator `name` when there is any (module docstring: why 0 and not the raw score)."""
    alone = count <= 1
    if bool(alone.any()):
        warn_once(
            f"group-of-one:{name}",
            f"{name}: {int(alone.sum())} episode(s) alone in their group get advantage 0 (no baseline, so no "
            "signal); sample at least two episodes per prompt (rollout.group_size >= 2), or see why the others "
            "failed (they are left out: algorithm.failed_episodes). Warned once.",
            GroupOfOneWarning,
        )
    return torch.where(alone, torch.zeros_like(advantage), advantage)


def require_values(name: str, values: torch.Tensor | None) -> torch.Tensor:
    if values is None:
        raise ValueError(
            f"advantage estimator {name!r} needs a critic: pass values [E, T] (or use a critic-free "
            f"estimator: grpo, rloo, reinforce_pp, reinforce_pp_baseline)"
        )
    return values


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


def broadcast_to_tokens(per_episode: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[E] -> [E, T] float64, zero off the mask."""
    return per_episode.to(torch.float64)[:, None] * mask.to(torch.float64)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch, zero off the mask.

    Token-weighted, like verl's ``masked_whiten`` (a long episode counts once per token) with the
    unbiased (n - 1) variance; fewer than two masked entries give std 0. float64 in, float64 out.
    """
    weights = mask.to(torch.float64)
    count = weights.sum()
    if count == 0:
        return torch.zeros_like(x, dtype=torch.float64)
    mean = (x * weights).sum() / count
    var = (((x - mean) ** 2) * weights).sum() / (count - 1) if count > 1 else torch.zeros((), dtype=torch.float64)
    return (x - mean) / (var.sqrt() + eps) * weights


def step_index(on: torch.Tensor, step_starts: torch.Tensor | None, estimator: str) -> torch.Tensor:
    """Each column's step number within its row (-1 before the row's first step start), int64 [E, T],
    for the step-level estimators (`step_gae`, `gigpo`); ValueError naming `estimator` when
    step_starts is missing, marks a token off the mask `on`, or a masked token comes before it."""
    if step_starts is None:
        raise ValueError(f"advantage estimator '{estimator}' needs step_starts [E, T] "
                         "(True at each step's first action token)")
    starts = step_starts.to(torch.bool)
    if bool((starts & ~on).any()):
        raise ValueError(f"{estimator}: step_starts marks a token outside the mask; a step starts at an action token")
    step = starts.to(torch.long).cumsum(dim=-1) - 1
    if bool((on & (step < 0)).any()):
        rows = sorted(set((on & (step < 0)).nonzero()[:, 0].tolist()))
        raise ValueError(f"{estimator}: episodes {rows[:10]} have masked tokens before their first step start")
    return step
