"""Every mask used in training is built or combined here, and only here (DESIGN.md §3).

Vocabulary (all masks are [B, L], 1 = the token takes part, 0 = it does not):

- ``attention_mask``: padding only (1 on real tokens, 0 on padding).
- ``action_mask``: 1 on tokens the policy sampled (response tokens), 0 on the prompt, tool output
  and chat-template glue.
- **loss mask**: the tokens the policy loss (and the entropy / KL terms) is averaged over.
  On (default) = ``action_mask``. Off (the paper's ablation) = every non-padding token, so the
  policy is also trained on observation and prompt tokens.
- **advantage mask**: the tokens the advantage / return recursion runs over. On (default) =
  ``action_mask``: the value at the last token of action k bootstraps from the first token of
  action k+1 and tool output is skipped. Off (ablation) = every non-padding token.

Where this differs from a plain ``attention_mask`` for the "off" masks: the first real token of a
sequence is never in a mask, because nothing conditions it (its log-probability is defined as 0
by ``agent_core.training.trainer.sequence_logprobs``); counting it would only dilute token means.
For the same reason a step must have at least one prompt token.

The Agent-R1 ablation (PPO 0.3719 -> 0.3136 with the advantage mask off -> 0.3022 with the loss
mask off too) is reproduced by ``use_advantage_mask`` / ``use_loss_mask`` of ``derive_masks``.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    loss_mask: tokens the policy loss, entropy and KL terms are averaged over.
    advantage_mask: tokens that carry an advantage (advantages elsewhere are treated as 0).
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


def derive_masks(
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    use_loss_mask: bool,
    use_advantage_mask: bool,
) -> Masks:
    """Loss and advantage masks from the action and attention masks.

    action_mask, attention_mask: [B, L] (any numeric/bool dtype, values 0/1).
    use_loss_mask / use_advantage_mask: True = the mask is the action mask (default);
    False = every predicted non-padding token (``predicted_token_mask``), the ablation.
    Returns float32 [B, L] masks; the action mask is also cut to non-padding tokens so a
    mislabelled padding position can never enter the loss.
    """
    if action_mask.shape != attention_mask.shape or action_mask.dim() != 2:
        raise ValueError(
            f"action_mask and attention_mask must both be [B, L]; got "
            f"{tuple(action_mask.shape)} and {tuple(attention_mask.shape)}"
        )
    on = action_mask.to(torch.float32) * attention_mask.to(torch.float32)
    off = predicted_token_mask(attention_mask)
    return Masks(
        loss_mask=on if use_loss_mask else off,
        advantage_mask=on if use_advantage_mask else off,
    )
