"""Every mask used in training is built or combined here, and only here (docs/architecture.md §3).

All masks are [B, L], 1 = the token takes part: ``attention_mask`` (padding), ``action_mask`` (tokens the
policy sampled), the loss mask and the advantage mask (each ``action_mask`` when on, the row's response region
when off). The first real token of a sequence is never in a mask. ``use_advantage_mask`` / ``use_loss_mask``
of ``derive_masks`` reproduce the Agent-R1 ablation.
Design notes: docs/architecture.md §11 (agent_core/algos/masks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def action_mask_for_step(prompt_len: int, response_len: int) -> torch.Tensor:
    """Action mask of one step sequence ``prompt_ids + response_ids``.

    Returns an int64 tensor of shape [prompt_len + response_len]: 0 on the prompt, 1 on the
    response (the policy-sampled tokens).
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 (a first token has no context), got {prompt_len}")
    if response_len < 0:
        raise ValueError(f"response_len must be >= 0, got {response_len}")
    mask = torch.zeros(prompt_len + response_len, dtype=torch.long)
    mask[prompt_len:] = 1
    return mask


@dataclass(frozen=True)
class Masks:
    """The two masks a policy update uses, float32 tensors of shape [B, L] with values 0/1.

    loss_mask: tokens the policy loss, entropy and KL terms are averaged over; each is trained
        with the advantage stored for it.
    advantage_mask: tokens the advantage recursion ran over: the critic's value-target tokens.
    """

    loss_mask: torch.Tensor
    advantage_mask: torch.Tensor


def predicted_token_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Every real token except the first of each row (the tokens a model predicts), float [B, L].

    Works for left or right padding: the first token is the first 1 of each row.
    """
    real = attention_mask.to(torch.float32)
    first = (real.cumsum(dim=-1) == 1) & (real > 0)
    return real * (~first).to(torch.float32)


def first_action_index(action_mask: Sequence[int]) -> int:
    """Index of a row's first action token (its length when it has none): the default
    ``response_start`` of a row that carries no observation before its first action."""
    return next((i for i, flag in enumerate(action_mask) if flag), len(action_mask))


def response_region_mask(attention_mask: torch.Tensor, response_start: torch.Tensor | None,
                         action_mask: torch.Tensor) -> torch.Tensor:
    """The response region (module docstring) of each row, float32 [B, L]: predicted real tokens
    at positions >= response_start (int [B]; None = each row's first action token)."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    if response_start is None:
        acting = action_mask.to(torch.bool) & attention_mask.to(torch.bool)
        response_start = torch.where(acting, positions, attention_mask.shape[-1]).min(dim=-1).values
    after = positions[None, :] >= response_start.to(positions.device)[:, None]
    return predicted_token_mask(attention_mask) * after.to(torch.float32)


def derive_masks(
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    use_loss_mask: bool,
    use_advantage_mask: bool,
    response_start: torch.Tensor | None = None,
) -> Masks:
    """Loss and advantage masks from the action and attention masks.

    action_mask, attention_mask: [B, L] (any numeric/bool dtype, values 0/1).
    response_start: int [B], where each row's response region starts (None: at its first action
    token, right for step rows without an observation prefix and for packed rows).
    use_loss_mask / use_advantage_mask: True = the mask is the action mask (default);
    False = the response region (``response_region_mask``), the ablation.
    Returns float32 [B, L] masks; the action mask is also cut to non-padding tokens so a
    mislabelled padding position can never enter the loss.
    """
    if action_mask.shape != attention_mask.shape or action_mask.dim() != 2:
        raise ValueError(
            f"action_mask and attention_mask must both be [B, L]; got "
            f"{tuple(action_mask.shape)} and {tuple(attention_mask.shape)}"
        )
    if response_start is not None and tuple(response_start.shape) != (action_mask.shape[0],):
        raise ValueError(f"response_start must be [B] with B = {action_mask.shape[0]}; got {tuple(response_start.shape)}")
    on = action_mask.to(torch.float32) * attention_mask.to(torch.float32)
    off = response_region_mask(attention_mask, response_start, action_mask)
    return Masks(
        loss_mask=on if use_loss_mask else off,
        advantage_mask=on if use_advantage_mask else off,
    )


def grid_advantage_mask(action_mask: torch.Tensor, real_mask: torch.Tensor, use_advantage_mask: bool) -> torch.Tensor:
    """The estimators' mask on the episode grid (``agent_core.algos.episodes``), float32 [E, T]:
    action tokens when on (default), every real token of the row (its response region: actions
    and observations) when off (the ablation)."""
    chosen = action_mask if use_advantage_mask else real_mask
    return chosen.to(torch.float32)
