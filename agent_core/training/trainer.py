"""Token log-probs of a causal LM and one PPO optimizer step over training sequences.

``ppo_update`` makes exactly one optimizer step per call: the sequences are split into
micro-batches whose losses use normalizers counted over ALL sequences, so the accumulated
gradient equals that of one big batch. A non-finite loss or gradient norm skips the step.

Where this differs from verl-style trainers: the "old" log-probs are the engine's sampling
log-probs, which exist only on action tokens. With the loss mask off (the ablation), tokens in the
loss but outside the action have no sampling log-prob; they take the current policy's own
(detached) log-prob, i.e. ratio 1, which is exact here because the policy does not change during
the one step. Otherwise they would be compared with a placeholder 0 and almost always clipped away.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from agent_core.algos.losses import aggregate_loss, entropy_from_logits, masked_sum, ppo_clip_loss
from agent_core.algos.masks import Masks, derive_masks
from agent_core.training.batches import PaddedBatch, TrainSequence, make_micro_batches


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of a causal LM, both float32 [B, L].

    input_ids, attention_mask: [B, L]. Position t holds log p(input_ids[t] | input_ids[<t]) under
    softmax(logits / temperature), and the entropy of that distribution; position 0 (no context)
    and padding positions hold 0. entropy_grad=False computes the entropy without autograd
    (row by row, bounding memory) when it is only a metric.
    Memory: log p is logit[target] - logsumexp(logits), so no [B, L, V] log-softmax is built; the
    only full-size copies are the temperature division / float32 upcast (skipped when not needed)
    and the softmax inside the entropy.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    scores = logits[:, :-1]
    if scores.dtype != torch.float32:
        scores = scores.float()
    if temperature != 1.0:
        scores = scores / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    token_logprobs = scores.gather(-1, targets).squeeze(-1) - torch.logsumexp(scores, dim=-1)
    if entropy_grad:
        entropy = entropy_from_logits(scores)
    else:
        with torch.no_grad():
            entropy = torch.cat([entropy_from_logits(row[None]) for row in scores.detach()], dim=0)
    first = token_logprobs.new_zeros(input_ids.shape[0], 1)
    real = attention_mask.to(torch.float32)
    return torch.cat([first, token_logprobs], dim=1) * real, torch.cat([first, entropy], dim=1) * real


def make_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999)
) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (one group: weight decay applies to all)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (requires_grad is False everywhere)")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


@dataclass(frozen=True)
class UpdateResult:
    """Metrics of one optimizer step (one row of train_metrics).

    loss = pg_loss - entropy_coef * entropy term. entropy, kl (k3 estimate of KL(old || new)) and
    clipfrac are token means over the loss mask. tokens: tokens in the loss mask. skipped: the
    step was not taken (skip_reason says why); loss, pg_loss, entropy, kl and clipfrac are then nan.
    """

    loss: float
    pg_loss: float
    entropy: float
    kl: float
    clipfrac: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    skipped: bool
    skip_reason: str | None


@dataclass(frozen=True)
class _Normalizers:
    num_tokens: float
    num_sequences: float
    norm_length: float


def _normalizers(all_masks: list[Masks], norm_length: float | None) -> _Normalizers:
    per_row = torch.cat([m.loss_mask.sum(dim=-1) for m in all_masks])
    return _Normalizers(
        num_tokens=float(per_row.sum()),
        num_sequences=float((per_row > 0).sum()),
        norm_length=float(per_row.max()) if norm_length is None else float(norm_length),
    )


@dataclass
class _Totals:
    loss: float = 0.0
    pg_loss: float = 0.0
    entropy_sum: float = 0.0
    kl_sum: float = 0.0
    clipped_sum: float = 0.0


@dataclass(frozen=True)
class _LossSettings:
    clip_low: float
    clip_high: float
    dual_clip: float | None
    entropy_coef: float
    temperature: float
    agg_mode: str


def _micro_batch_step(
    model: torch.nn.Module, batch: PaddedBatch, masks: Masks, norms: _Normalizers, settings: _LossSettings,
    totals: _Totals,
) -> torch.Tensor:
    """Forward + backward of one micro-batch; adds its metrics to totals, returns its loss."""
    logprobs, entropy = sequence_logprobs(
        model, batch.input_ids, batch.attention_mask,
        temperature=settings.temperature, entropy_grad=settings.entropy_coef != 0,
    )
    # Loss tokens the engine did not sample have no sampling log-prob: use the current one (ratio 1).
    unsampled = (masks.loss_mask > 0) & (batch.action_mask == 0)
    old_logprobs = torch.where(unsampled, logprobs.detach(), batch.old_logprobs)
    advantages = batch.advantages * masks.advantage_mask
    scale = dict(num_tokens=norms.num_tokens, num_sequences=norms.num_sequences, norm_length=norms.norm_length)
    policy = ppo_clip_loss(
        logprobs, old_logprobs, advantages, masks.loss_mask, clip_low=settings.clip_low,
        clip_high=settings.clip_high, dual_clip=settings.dual_clip, agg_mode=settings.agg_mode, **scale,
    )
    loss = policy.loss
    if settings.entropy_coef != 0:
        loss = loss - settings.entropy_coef * aggregate_loss(entropy, masks.loss_mask, settings.agg_mode, **scale)
    loss.backward()
    batch_tokens = float(masks.loss_mask.sum())
    totals.loss += float(loss.detach())
    totals.pg_loss += float(policy.loss.detach())
    totals.entropy_sum += float(masked_sum(entropy.detach(), masks.loss_mask))
    totals.kl_sum += float(policy.approx_kl) * batch_tokens
    totals.clipped_sum += float(policy.clipfrac) * batch_tokens
    return loss.detach()


def _clip_and_step(optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> tuple[float, str | None]:
    """Clip the accumulated gradients and step, unless their norm is not finite."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    limit = math.inf if max_grad_norm is None else max_grad_norm
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
    if not math.isfinite(grad_norm):
        return grad_norm, f"non-finite gradient norm ({grad_norm})"
    optimizer.step()
    return grad_norm, None


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: Sequence[TrainSequence],
    *,
    pad_id: int,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    entropy_coef: float,
    max_grad_norm: float | None,
    micro_batch_tokens: int,
    temperature: float,
    agg_mode: str,
    use_loss_mask: bool = True,
    use_advantage_mask: bool = True,
    norm_length: float | None = None,
) -> UpdateResult:
    """ONE optimizer step of the PPO clipped objective over all `sequences`.

    Gradients are accumulated over micro-batches of <= micro_batch_tokens padded tokens with
    normalizers counted over all sequences, then clipped to max_grad_norm (None: not clipped).
    norm_length: the seq-mean-token-sum-norm constant (default: the largest number of loss tokens
    in one sequence of this update; pass the generation budget for Dr.GRPO's fixed constant).
    The learning rate is read from the optimizer (the caller owns the schedule). The model is in
    train mode during the update and gets its previous mode back afterwards.
    """
    if not sequences:
        raise ValueError("ppo_update needs at least one sequence")
    started = time.perf_counter()
    settings = _LossSettings(clip_low, clip_high, dual_clip, entropy_coef, temperature, agg_mode)
    device = next(model.parameters()).device
    batches = [b.to(device) for b in make_micro_batches(sequences, max_tokens=micro_batch_tokens, pad_id=pad_id)]
    all_masks = [derive_masks(b.action_mask, b.attention_mask, use_loss_mask=use_loss_mask,
                              use_advantage_mask=use_advantage_mask) for b in batches]
    norms = _normalizers(all_masks, norm_length)
    totals, grad_norm = _Totals(), math.nan
    skip_reason = None if norms.num_tokens > 0 else "no tokens in the loss mask"
    was_training = model.training
    model.train()
    optimizer.zero_grad(set_to_none=True)
    try:
        for batch, masks in zip(batches, all_masks):
            if skip_reason is not None:
                break
            batch_loss = _micro_batch_step(model, batch, masks, norms, settings, totals)
            if not torch.isfinite(batch_loss):
                skip_reason = f"non-finite loss ({float(batch_loss)}) in a micro-batch"
        if skip_reason is None:
            grad_norm, skip_reason = _clip_and_step(optimizer, max_grad_norm)
        optimizer.zero_grad(set_to_none=True)
    finally:
        model.train(was_training)
    return _result(totals, norms, grad_norm, float(optimizer.param_groups[0]["lr"]), started, skip_reason)


def _result(
    totals: _Totals, norms: _Normalizers, grad_norm: float, lr: float, started: float, skip_reason: str | None
) -> UpdateResult:
    skipped = skip_reason is not None
    tokens = math.nan if skipped else norms.num_tokens
    return UpdateResult(
        loss=math.nan if skipped else totals.loss,
        pg_loss=math.nan if skipped else totals.pg_loss,
        entropy=totals.entropy_sum / tokens,
        kl=totals.kl_sum / tokens,
        clipfrac=totals.clipped_sum / tokens,
        grad_norm=grad_norm,
        lr=lr,
        tokens=int(norms.num_tokens),
        seconds=time.perf_counter() - started,
        skipped=skipped,
        skip_reason=skip_reason,
    )
