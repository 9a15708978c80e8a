"""Critic-based advantage estimators: token-level ``gae`` and per-step ``step_gae``.

GAE (Schulman et al. 2016) with Agent-R1's advantage mask (docs/architecture.md §3): the recursion runs over
masked tokens only, so action k bootstraps from action k+1's first token, skipping tool output in between.
Advantages are whitened over the batch's masked tokens (``whiten=True``, the default); returns are not.
Differs from the convention: every episode, truncated ones too, ends after its last masked token (value 0).
Design notes: docs/architecture.md §11 (agent_core/algos/estimators_critic.py).
"""

from __future__ import annotations

import torch

from agent_core.algos.estimator_core import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutput,
    masked_whiten,
    require_values,
    step_index,
    uses_critic,
)


@ADVANTAGE_ESTIMATORS.register("gae")
@uses_critic
def gae_advantages(inputs: AdvantageInputs) -> AdvantageOutput:
    """Token-level GAE over the masked tokens (Schulman et al. 2016).

    Reads token_rewards, mask, values [E, T], gamma, lam, eps, whiten; outputs [E, T].
    For masked tokens t < t' (t' the next masked token of the row, none after the last):
    delta_t = r_t + gamma * V_t' - V_t (V_t' = 0 after the last), A_t = delta_t + gamma*lam*A_t'.
    returns = advantages + values on masked tokens. whiten: advantages (not returns) whitened over
    the masked tokens of the batch with eps (module docstring). ValueError when values is None.
    """
    values = require_values("gae", inputs.values)
    gamma, lam = inputs.gamma, inputs.lam
    on = inputs.mask.to(torch.bool)
    rewards = torch.where(on, inputs.token_rewards.to(torch.float64), 0.0)
    critic = torch.where(on, values.to(torch.float64), 0.0)
    num_episodes, width = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(num_episodes, dtype=torch.float64, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(width)):
        delta = rewards[:, t] + gamma * next_value - critic[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(on[:, t], advantage, 0.0)
        next_value = torch.where(on[:, t], critic[:, t], next_value)
        next_advantage = torch.where(on[:, t], advantage, next_advantage)
    returns = torch.where(on, advantages + critic, 0.0)
    if inputs.whiten:
        advantages = masked_whiten(advantages, on, inputs.eps)
    return AdvantageOutput(advantages=advantages.to(torch.float32), returns=returns.to(torch.float32))


@ADVANTAGE_ESTIMATORS.register("step_gae")
@uses_critic
def step_gae_advantages(inputs: AdvantageInputs) -> AdvantageOutput:
    """Step-level GAE: one value and one advantage per agent step (the step is the MDP action).

    Reads token_rewards, mask, values, step_starts [E, T], gamma, lam, eps, whiten; outputs [E, T].
    Step k's segment runs from its step start to the column before the next step start.
    R_k = sum of the masked token rewards of the segment, V_k = values at the step start;
    delta_k = R_k + gamma * V_{k+1} - V_k (V_K = 0), A_k = delta_k + gamma*lam*A_{k+1}.
    A_k is broadcast to the masked tokens of segment k; returns = A_k + V_k there (the step's
    value target). whiten: the broadcast advantages (not returns) whitened over the masked tokens
    of the batch with eps, so a step weighs by its token count. ValueError when values or
    step_starts is None.
    """
    values = require_values("step_gae", inputs.values)
    gamma, lam, step_starts = inputs.gamma, inputs.lam, inputs.step_starts
    on = inputs.mask.to(torch.bool)
    step = step_index(on, step_starts, "step_gae")
    index = step.clamp(min=0)
    num_steps = max(int(step.max().item()) + 1, 1) if step.numel() else 1
    rewards = torch.where(on, inputs.token_rewards.to(torch.float64), 0.0)
    at_start = step_starts.to(torch.bool)
    start_values = torch.where(at_start, values.to(torch.float64), 0.0)
    grid = torch.zeros(rewards.shape[0], num_steps, dtype=torch.float64, device=rewards.device)
    step_rewards = grid.scatter_add(1, index, rewards)
    step_values = grid.scatter_add(1, index, start_values)
    step_advantages = torch.zeros_like(grid)
    next_value = torch.zeros(grid.shape[0], dtype=torch.float64, device=grid.device)
    next_advantage = torch.zeros_like(next_value)
    # Steps a row does not have hold zero reward and value, so they keep next_* at zero.
    for k in reversed(range(num_steps)):
        delta = step_rewards[:, k] + gamma * next_value - step_values[:, k]
        next_advantage = delta + gamma * lam * next_advantage
        next_value = step_values[:, k]
        step_advantages[:, k] = next_advantage
    advantages = torch.where(on, step_advantages.gather(1, index), 0.0)
    returns = torch.where(on, (step_advantages + step_values).gather(1, index), 0.0)
    if inputs.whiten:
        advantages = masked_whiten(advantages, on, inputs.eps)
    return AdvantageOutput(advantages=advantages.to(torch.float32), returns=returns.to(torch.float32))
