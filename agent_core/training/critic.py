"""The PPO critic: the policy's transformer backbone with a scalar value head, and batched scoring.

``ValueModel`` = a copy of the policy's backbone (no LM head) + ``Linear(hidden, 1)``, zero-initialised.
``values`` follows the log-prob alignment of ``sequence_logprobs``: position t holds V(state before token t).
Where this differs from verl/OpenRLHF critics: they read the value at t from the hidden state AT t (after the
token). ``build_critic``/``load_critic`` build one; ``score_logprobs``/``score_values`` are no-grad scorers.
Design notes: docs/architecture.md §11 (agent_core/training/critic.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch

from agent_core.io.checkpoints import load_critic_parts, load_policy
from agent_core.training.scoring import model_mask, score_in_micro_batches, score_logprobs

__all__ = ["ValueModel", "value_model_from_policy", "build_critic", "load_critic", "score_logprobs", "score_values"]


class ValueModel(torch.nn.Module):
    """Backbone (a transformers base model returning last_hidden_state) + float32 scalar head."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden_size = backbone.config.hidden_size
        device = next(backbone.parameters()).device
        self.value_head = torch.nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, right_padded: bool = False) -> torch.Tensor:
        """Float32 [B, L]: position t = V(tokens < t) = head(hidden[t - 1]); position 0 and padding 0.
        right_padded: the model gets no mask (``scoring.model_mask``)."""
        mask = model_mask(attention_mask, right_padded)
        hidden = self.backbone(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
        per_state = self.value_head(hidden[:, :-1].float()).squeeze(-1)
        first = per_state.new_zeros(per_state.shape[0], 1)
        return torch.cat([first, per_state], dim=1) * attention_mask.to(torch.float32)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.values(input_ids, attention_mask)


def value_model_from_policy(policy: torch.nn.Module) -> ValueModel:
    """A critic on a deep copy of `policy`'s backbone (``base_model``: the model without its LM head)."""
    backbone = getattr(policy, "base_model", None)
    if backbone is None or backbone is policy:
        raise ValueError(f"{type(policy).__name__} has no separate base model to put a value head on")
    return ValueModel(copy.deepcopy(backbone))


def build_critic(policy_dir: Path, *, dtype: torch.dtype = torch.float32) -> ValueModel:
    """A fresh critic from the policy checkpoint in `policy_dir` (its weights, a zero value head)."""
    policy, _ = load_policy(Path(policy_dir), dtype=dtype)
    return ValueModel(policy.base_model)


def load_critic(directory: Path, *, dtype: torch.dtype = torch.float32) -> ValueModel:
    """Load a critic written by ``save_critic`` (offline; train/eval mode is the caller's)."""
    backbone, head = load_critic_parts(Path(directory), dtype=dtype)
    critic = ValueModel(backbone)
    critic.value_head.load_state_dict(head)
    return critic


def score_values(
    critic: ValueModel, sequences: Sequence[Sequence[int]], pad_id: int, max_tokens: int, precision: str = "fp32"
) -> list[list[float]]:
    """Per-token values of each token sequence (position 0: 0.0), micro-batched by tokens, no grad, under
    the trainer's `precision`."""
    return score_in_micro_batches(sequences, pad_id, max_tokens,
                                  lambda batch: critic.values(batch.input_ids, batch.attention_mask, right_padded=True), critic,
                                  precision=precision)
