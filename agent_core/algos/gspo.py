"""GSPO, the sequence-level policy loss (Zheng et al. 2025, arXiv 2507.18071), on the step-level MDP.

One importance ratio per sequence, s_i = exp(mean_t (logp_t - old_logp_t)), clipped at the sequence level and
weighed by one advantage per sequence (the mean of its tokens' advantages). Unlike the single-turn paper, a
"sequence" is one action (one agent step) of a multi-turn episode, a maximal run of loss-mask tokens
(``action_segments``); observations and template glue are in no sequence. dual_clip is accepted and ignored.
Design notes: docs/architecture.md §11 (agent_core/algos/gspo.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agent_core.algos.losses import (
    MAX_LOG_RATIO, POLICY_LOSSES, PolicyLossOutput, aggregate_loss, check_policy_inputs, masked_mean,
)


@dataclass(frozen=True)
class Segments:
    """The action segments of a [B, L] batch: maximal runs of loss-mask tokens along each row.

    ids: int64 [B, L], each loss token's segment (numbered 0..count-1 row by row, left to right),
        ``count`` outside the mask: a spare slot that sums are thrown away from, so whatever a
        token outside the mask holds (inf, nan) reaches no result and no gradient.
    on: bool [B, L], the loss mask.
    lengths: float [count], tokens per segment. rows: int64 [count], each segment's row.
    """

    ids: torch.Tensor
    on: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.lengths.numel())

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean of values [B, L] over each segment's tokens: [count] (values outside the mask land
        in the spare slot, which is dropped)."""
        sums = values.new_zeros(self.count + 1).index_add(0, self.ids.flatten(), values.flatten())
        return sums[: self.count] / self.lengths.to(values.dtype)

    def broadcast(self, per_segment: torch.Tensor) -> torch.Tensor:
        """Each segment's value on its tokens, 0 elsewhere: [count] -> [B, L]."""
        return torch.cat([per_segment, per_segment.new_zeros(1)])[self.ids]  # the spare slot holds 0


def action_segments(loss_mask: torch.Tensor) -> Segments:
    """The segments (one per action) of a [B, L] loss mask; see ``Segments``."""
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, L]; got {tuple(loss_mask.shape)}")
    on = loss_mask > 0
    before = torch.zeros_like(on)
    before[:, 1:] = on[:, :-1]
    starts = on & ~before
    numbered = starts.flatten().to(torch.long).cumsum(0).view(on.shape) - 1  # row-major: rows never share one
    count = int(starts.sum())
    ids = torch.where(on, numbered, count)
    lengths = torch.zeros(count + 1, dtype=torch.float32, device=on.device).index_add(
        0, ids.flatten(), on.flatten().to(torch.float32))[:count]
    rows = starts.nonzero()[:, 0]
    return Segments(ids=ids, on=on, lengths=lengths, rows=rows)


def sequence_log_ratios(logprobs: torch.Tensor, old_logprobs: torch.Tensor, segments: Segments) -> torch.Tensor:
    """log s_i = mean over segment i of the token log-ratios, each clamped to +-MAX_LOG_RATIO: [count]."""
    return segments.mean((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_length: float | None = None,
    options: Any = None,
) -> PolicyLossOutput:
    """GSPO loss over action segments (module docstring). All inputs [B, L]; aggregated by `agg_mode`.

    s_i = exp(mean over segment i of (logprobs - old_logprobs)); A_i = mean advantage of segment i;
    loss_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip_low, 1 + clip_high)), put on every token
    of segment i and reduced by ``aggregate_loss``. dual_clip: ignored. The defaults are the
    paper's clip range and averaging over sequences; the trainer passes the config's values.
    """
    check_policy_inputs(logprobs, old_logprobs, advantages, loss_mask)
    mask = loss_mask.to(logprobs.dtype)
    segments = action_segments(loss_mask)
    log_ratio = sequence_log_ratios(logprobs, old_logprobs, segments)
    ratio = torch.exp(log_ratio)
    advantage = segments.mean(advantages.to(logprobs.dtype)).detach()
    unclipped = -advantage * ratio
    clipped = -advantage * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_segment = torch.maximum(unclipped, clipped)
    loss = aggregate_loss(segments.broadcast(per_segment), mask, agg_mode, num_tokens=num_tokens,
                          num_sequences=num_sequences, norm_length=norm_length)
    with torch.no_grad():
        was_clipped = segments.broadcast((clipped > unclipped).to(mask.dtype))
        clipfrac = masked_mean(was_clipped, mask)
        token_log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        token_log_ratio = torch.where(segments.on, token_log_ratio, torch.zeros_like(token_log_ratio))
        approx_kl = masked_mean(torch.exp(token_log_ratio) - 1.0 - token_log_ratio, mask)
    return PolicyLossOutput(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl)
