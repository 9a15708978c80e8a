"""Policy and value losses and loss aggregation (docs/architecture.md §7), pure torch.

Aggregation modes (``LOSS_AGG_MODES``): ``token-mean`` (verl's default; DAPO), ``seq-mean-token-mean``
(original GRPO), ``seq-mean-token-sum-norm`` (Dr.GRPO); a "sequence" is one training row (step or episode).
The optional normalizers count over the whole optimizer step, so micro-batch losses sum to one big batch's.
Policy losses (``POLICY_LOSSES``): ``ppo_clip`` (clip-higher, dual clip), ``gspo``; value loss: PPO2's clip.
Design notes: docs/architecture.md §11 (agent_core/algos/losses.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from agent_core.registry import Registry

# exp() of a log-ratio above ~88 overflows float32; 20 (a ratio of ~5e8) is already far outside any
# clip range, so clamping changes no clipped loss value and keeps a stale/garbage log-prob from
# turning the loss into inf/nan.
MAX_LOG_RATIO = 20.0


class LossAggregator(Protocol):
    def __call__(
        self,
        loss_mat: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: float | None,
        num_sequences: float | None,
        norm_length: float | None,
    ) -> torch.Tensor: ...


LOSS_AGG_MODES: Registry[LossAggregator] = Registry("loss aggregation mode")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x where mask is 1 (x and mask broadcastable)."""
    product = x * mask
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask is 1; 0 where the mask is empty (never nan)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def _count_sequences(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(dim=-1) > 0).sum().to(mask.dtype)


@LOSS_AGG_MODES.register("token-mean")
def _token_mean(loss_mat, mask, num_tokens, num_sequences, norm_length):
    denominator = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return masked_sum(loss_mat, mask) / denominator


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, num_tokens, num_sequences, norm_length):
    per_sequence = masked_mean(loss_mat, mask, dim=-1)
    denominator = _count_sequences(mask).clamp(min=1) if num_sequences is None else num_sequences
    return per_sequence.sum() / denominator


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, num_tokens, num_sequences, norm_length):
    length = loss_mat.shape[-1] if norm_length is None else norm_length
    per_sequence = masked_sum(loss_mat, mask, dim=-1) / length
    denominator = _count_sequences(mask).clamp(min=1) if num_sequences is None else num_sequences
    return per_sequence.sum() / denominator


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, L] over `mask` [B, L] to a scalar, by mode name.

    num_tokens: token-mean denominator (default: masked tokens in this batch).
    num_sequences: seq-mean denominator (default: sequences with a masked token in this batch).
    norm_length: seq-mean-token-sum-norm length constant (default: L, this batch's width; pass a
        constant such as the generation budget whenever batches differ in width).
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(f"loss_mat and mask must both be [B, L]; got {tuple(loss_mat.shape)} and {tuple(mask.shape)}")
    return LOSS_AGG_MODES.get(mode)(loss_mat, mask.to(loss_mat.dtype), num_tokens, num_sequences, norm_length)


@dataclass(frozen=True)
class PolicyLossOutput:
    """loss: scalar with grad. clipfrac, approx_kl: detached scalars (token means over the mask)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor


class PolicyLoss(Protocol):
    """A policy loss, called by the trainer once per micro-batch.

    logprobs: float [B, L], the current policy's log-probs of the sampled tokens (with grad);
    old_logprobs: float [B, L], the log-probs the advantages were computed under (no grad);
    advantages: float [B, L], each token's advantage; loss_mask: [B, L] 0/1, the tokens trained.
    clip_low, clip_high, dual_clip: clip settings, accepted and ignored by a loss that does not
    clip (so a config can switch losses by name alone). agg_mode, num_tokens, num_sequences,
    norm_length: how the per-token loss is reduced (``aggregate_loss``). options: the loss's own
    settings object (trainer.policy_loss_options validated by the settings model it was registered
    with, ``POLICY_LOSSES.register(name, settings=...)``); None for one registered without.
    Returns PolicyLossOutput: scalar loss with grad, detached clipfrac and approx_kl.
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        clip_low: float = ...,
        clip_high: float = ...,
        dual_clip: float | None = ...,
        agg_mode: str = ...,
        num_tokens: float | None = ...,
        num_sequences: float | None = ...,
        norm_length: float | None = ...,
        options: Any = ...,
    ) -> PolicyLossOutput: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def check_policy_inputs(logprobs, old_logprobs, advantages, loss_mask) -> None:
    """ValueError unless the four inputs of a policy loss share one [B, L] shape."""
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == loss_mask.shape) or logprobs.dim() != 2:
        raise ValueError(
            "logprobs, old_logprobs, advantages and loss_mask must share one [B, L] shape; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(advantages.shape)}, {tuple(loss_mask.shape)}"
        )


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg_mode: str = "token-mean",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_length: float | None = None,
    options: Any = None,
) -> PolicyLossOutput:
    """PPO clipped policy loss. All inputs [B, L]; the loss is aggregated by `agg_mode`.

    ratio = exp(clamp(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)); per token
    loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)); with dual_clip = c > 1,
    tokens with A < 0 take min(that, -A * c), bounding the loss of a very large ratio.
    clipfrac: share of masked tokens where a clip bound the loss (either clip).
    approx_kl: k3 estimate of KL(old || new), mean over masked tokens of (r - 1) - log r.
    """
    check_policy_inputs(logprobs, old_logprobs, advantages, loss_mask)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    mask = loss_mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (bound < per_token)
        per_token = torch.where(dual_active, bound, per_token)
        was_clipped = was_clipped | dual_active
    loss = aggregate_loss(
        per_token, mask, agg_mode, num_tokens=num_tokens, num_sequences=num_sequences, norm_length=norm_length
    )
    with torch.no_grad():
        clipfrac = masked_mean(was_clipped.to(mask.dtype), mask)
        approx_kl = masked_mean(ratio - 1.0 - log_ratio, mask)
    return PolicyLossOutput(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: [B, L, V] -> [B, L].

    H = logsumexp(z) - sum(softmax(z) * z), which needs one [B, L, V] probability tensor and no
    separate log-softmax copy.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


@dataclass(frozen=True)
class ValueLossOutput:
    """loss: scalar with grad (0.5 * squared error, aggregated). clipfrac: detached share of masked
    tokens where the clipped term was the larger one (the clip bound the loss)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None,
    agg_mode: str = "token-mean",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_length: float | None = None,
) -> ValueLossOutput:
    """PPO2-style clipped value loss, all inputs [B, L], aggregated over `mask` by `agg_mode`.

    per token = 0.5 * max((v - R)^2, (old_v + clamp(v - old_v, -clip_range, clip_range) - R)^2):
    the pessimistic of the plain and the clipped error, so the critic cannot gain by moving a value
    further than clip_range from the one the returns were computed with. clip_range None: no clip,
    0.5 * (v - R)^2. The mask is the advantage mask (the tokens that have a return).
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            "values, old_values, returns and mask must share one [B, L] shape; got "
            f"{tuple(values.shape)}, {tuple(old_values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}"
        )
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"clip_range must be > 0 (or None for no clip), got {clip_range}")
    mask = mask.to(values.dtype)
    plain = (values - returns).square()
    if clip_range is None:
        per_token, was_clipped = plain, torch.zeros_like(plain, dtype=torch.bool)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        per_token, was_clipped = torch.maximum(plain, clipped), clipped > plain
    loss = aggregate_loss(
        0.5 * per_token, mask, agg_mode, num_tokens=num_tokens, num_sequences=num_sequences, norm_length=norm_length
    )
    with torch.no_grad():
        clipfrac = masked_mean(was_clipped.to(mask.dtype), mask)
    return ValueLossOutput(loss=loss, clipfrac=clipfrac)
