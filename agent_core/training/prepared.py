"""One optimizer step's inputs, ready for the loss: micro-batches on the model's device, their
loss and advantage masks (``agent_core.algos.masks.derive_masks``, with each row's response
region) and the loss normalizers counted over ALL micro-batches of the step, so accumulated
micro-batch gradients equal one big batch's (``agent_core.training.trainer``). The same
normalizers make a micro-batch's loss a sum over its rows, so ``split_rows`` halves give the
whole's gradient (the out-of-memory retry, ``agent_core.training.oom``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from agent_core.algos.masks import Masks, derive_masks
from agent_core.training.batches import PaddedBatch, TrainSequence, make_micro_batches
from agent_core.training.memory import Auto, pending_state_bytes, resolve_micro_batch_tokens
from agent_core.training.precision import resolve_precision


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
    """Micro-batches of `sequences` (<= micro_batch_tokens padded tokens each), masks and normalizers.

    Masks, normalizers and each row's loss-target count are computed on the host before anything moves
    to the device, so none of them synchronises with it."""
    batches = make_micro_batches(sequences, max_tokens=micro_batch_tokens, pad_id=pad_id)
    masks = [derive_masks(b.action_mask, b.attention_mask, use_loss_mask=use_loss_mask,
                          use_advantage_mask=use_advantage_mask, response_start=b.response_start) for b in batches]
    kl_masks = [m.loss_mask * b.action_mask for m, b in zip(masks, batches)]
    prepared = Prepared(
        [replace(b, row_loss_targets=_loss_targets(m, b)).to(device) for b, m in zip(batches, masks)],
        [Masks(m.loss_mask.to(device), m.advantage_mask.to(device)) for m in masks],
        Normalizers.over([m.loss_mask for m in masks], norm_length), Normalizers.over(kl_masks, norm_length),
        Normalizers.over([m.advantage_mask for m in masks], norm_length))
    return prepared


def _loss_targets(masks: Masks, batch: PaddedBatch) -> tuple[int, ...]:
    """Per row, the tokens `scoring.sequence_logprobs` computes logits for under the loss mask."""
    targets = (masks.loss_mask[:, 1:] > 0) & (batch.attention_mask[:, 1:] > 0)
    return tuple(int(n) for n in targets.sum(dim=-1).tolist())


def _rows(value, part: slice, width: int):
    """Rows `part` of a [B, L] tensor (first `width` columns), of a [B] tensor or of a tuple."""
    if isinstance(value, torch.Tensor):
        return value[part, :width] if value.dim() == 2 else value[part]
    return value[part] if isinstance(value, tuple) else value


def split_rows(*items):
    """The two halves (by rows) of a micro-batch and what goes with it row for row (its masks),
    each cut to its longest row (the first item's attention mask says where rows end)."""
    rows = items[0].input_ids.shape[0]
    halves = []
    for part in (slice(0, (rows + 1) // 2), slice((rows + 1) // 2, rows)):
        width = int(items[0].attention_mask[part].sum(dim=-1).max())
        halves.append(tuple(replace(item, **{f.name: _rows(getattr(item, f.name), part, width) for f in fields(item)})
                            for item in items))
    return halves


def loss_token_fraction(sequences: Sequence[TrainSequence], use_loss_mask: bool) -> float:
    """The largest share of one row's tokens in the loss (action tokens, or the response region with
    the loss mask off): the share of logits the selective LM head computes in any micro-batch."""
    def share(q: TrainSequence) -> float:
        loss_tokens = sum(q.action_mask) if use_loss_mask else len(q) - q.region_start
        return loss_tokens / max(1, len(q))
    return max((share(q) for q in sequences), default=1.0)


def training_micro_batch_tokens(policy: torch.nn.Module, optimizer, sequences: Sequence[TrainSequence], *,
                                tokens: int | Auto, logits: int | Auto, precision: str, checkpointing: bool,
                                use_loss_mask: bool, critic: torch.nn.Module | None = None,
                                critic_optimizer=None) -> int:
    """The micro-batch token budget of a training iteration (``memory.resolve_micro_batch_tokens``):
    off CUDA, `tokens` ("auto": 8,192) capped by `logits` over the vocabulary, as before; on CUDA
    with "auto", from the device's free memory less the gradients and AdamW moments the policy
    (and critic) will still allocate, the precision, activation checkpointing, and the largest
    share of loss tokens in a row."""
    device = next(policy.parameters()).device
    pending = pending_state_bytes(policy, optimizer)
    pending += pending_state_bytes(critic, critic_optimizer) if critic is not None else 0
    return resolve_micro_batch_tokens(policy, tokens, logits, training=True,
                                      precision=resolve_precision(precision, device), checkpointing=checkpointing,
                                      pending_bytes=pending, loss_fraction=loss_token_fraction(sequences, use_loss_mask))
