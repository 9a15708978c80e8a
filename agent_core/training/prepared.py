"""One optimizer step's inputs, ready for the loss: micro-batches on the model's device, their
loss and advantage masks (``agent_core.algos.masks.derive_masks``, with each row's response
region) and the loss normalizers counted over ALL micro-batches of the step, so accumulated
micro-batch gradients equal one big batch's (``agent_core.training.trainer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agent_core.algos.masks import Masks, derive_masks
from agent_core.training.batches import PaddedBatch, TrainSequence, make_micro_batches


@dataclass(frozen=True)
class Normalizers:
    """Token count, sequence count (rows with any masked token) and the seq-mean-token-sum-norm
    length of one mask over a whole step."""

    num_tokens: float
    num_sequences: float
    norm_length: float

    @staticmethod
    def over(masks: Sequence[torch.Tensor], norm_length: float | None) -> "Normalizers":
        per_row = torch.cat([m.sum(dim=-1) for m in masks])
        return Normalizers(float(per_row.sum()), float((per_row > 0).sum()),
                           float(per_row.max()) if norm_length is None else float(norm_length))

    def scale(self) -> dict[str, float]:
        return dict(num_tokens=self.num_tokens, num_sequences=self.num_sequences, norm_length=self.norm_length)


@dataclass(frozen=True)
class Prepared:
    """A step's micro-batches on the model's device, their masks and loss normalizers.

    policy_norms: over the loss masks; kl_norms: over loss mask x action mask (the tokens with a
    reference log-prob); value_norms: over the advantage masks (the critic's target tokens).
    """

    batches: list[PaddedBatch]
    masks: list[Masks]
    policy_norms: Normalizers
    kl_norms: Normalizers
    value_norms: Normalizers


def prepare_update(sequences: Sequence[TrainSequence], device, *, pad_id: int, micro_batch_tokens: int,
                   use_loss_mask: bool, use_advantage_mask: bool, norm_length: float | None) -> Prepared:
    """Micro-batches of `sequences` (<= micro_batch_tokens padded tokens each), masks and normalizers."""
    batches = [b.to(device) for b in make_micro_batches(sequences, max_tokens=micro_batch_tokens, pad_id=pad_id)]
    masks = [derive_masks(b.action_mask, b.attention_mask, use_loss_mask=use_loss_mask,
                          use_advantage_mask=use_advantage_mask, response_start=b.response_start) for b in batches]
    kl_masks = [m.loss_mask * b.action_mask for m, b in zip(masks, batches)]
    return Prepared(batches, masks, Normalizers.over([m.loss_mask for m in masks], norm_length),
                    Normalizers.over(kl_masks, norm_length),
                    Normalizers.over([m.advantage_mask for m in masks], norm_length))
