"""Training sequences and padded micro-batches.

A ``TrainSequence`` is one row of a policy update: token ids with, position for position, the
action mask, the log-probs of the sampling policy and the advantages (zeros off the action, where
the engine produced no log-prob and the estimator no advantage). One agent step gives one
sequence (``step_sequence``); a packed append-only episode is a sequence whose action mask covers
several responses, so the trainer needs no change for it.

Alignment: position t holds values for token t itself (its log-prob given tokens < t), matching
``agent_core.training.trainer.sequence_logprobs``; nothing is shifted here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agent_core.algos.masks import action_mask_for_step


@dataclass(frozen=True)
class TrainSequence:
    """One training row; all four lists have the same length L."""

    input_ids: list[int]
    action_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]

    def __post_init__(self) -> None:
        lengths = {
            "input_ids": len(self.input_ids),
            "action_mask": len(self.action_mask),
            "old_logprobs": len(self.old_logprobs),
            "advantages": len(self.advantages),
        }
        if len(set(lengths.values())) != 1:
            raise ValueError(f"TrainSequence fields disagree in length: {lengths}")
        if not self.input_ids:
            raise ValueError("TrainSequence is empty (no input_ids)")

    def __len__(self) -> int:
        return len(self.input_ids)


def step_sequence(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    response_logprobs: Sequence[float],
    advantages: Sequence[float],
) -> TrainSequence:
    """The training row of one agent step: prompt + response, with the action on the response."""
    if not (len(response_ids) == len(response_logprobs) == len(advantages)):
        raise ValueError(
            f"step lengths disagree: response_ids has {len(response_ids)} tokens, response_logprobs "
            f"{len(response_logprobs)}, advantages {len(advantages)}"
        )
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: a step needs at least one prompt token")
    prompt_len = len(prompt_ids)
    return TrainSequence(
        input_ids=[int(t) for t in prompt_ids] + [int(t) for t in response_ids],
        action_mask=action_mask_for_step(prompt_len, len(response_ids)).tolist(),
        old_logprobs=[0.0] * prompt_len + [float(x) for x in response_logprobs],
        advantages=[0.0] * prompt_len + [float(x) for x in advantages],
    )


@dataclass(frozen=True)
class PaddedBatch:
    """Right-padded micro-batch, all tensors [B, L].

    input_ids, attention_mask, action_mask: int64. old_logprobs, advantages: float32 (0 on
    padding). indices: position of each row in the list given to ``make_micro_batches``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    indices: tuple[int, ...]

    def to(self, device: torch.device | str) -> "PaddedBatch":
        return PaddedBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            action_mask=self.action_mask.to(device),
            old_logprobs=self.old_logprobs.to(device),
            advantages=self.advantages.to(device),
            indices=self.indices,
        )


def _pad(sequences: list[TrainSequence], indices: tuple[int, ...], pad_id: int) -> PaddedBatch:
    width = max(len(s) for s in sequences)
    shape = (len(sequences), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    action_mask = torch.zeros(shape, dtype=torch.long)
    old_logprobs = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        n = len(sequence)
        input_ids[row, :n] = torch.tensor(sequence.input_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        action_mask[row, :n] = torch.tensor(sequence.action_mask, dtype=torch.long)
        old_logprobs[row, :n] = torch.tensor(sequence.old_logprobs, dtype=torch.float32)
        advantages[row, :n] = torch.tensor(sequence.advantages, dtype=torch.float32)
    return PaddedBatch(input_ids, attention_mask, action_mask, old_logprobs, advantages, indices)


def make_micro_batches(sequences: Sequence[TrainSequence], *, max_tokens: int, pad_id: int) -> list[PaddedBatch]:
    """Group sequences into right-padded micro-batches of at most `max_tokens` padded tokens.

    Sequences are sorted longest first (less padding), then filled greedily: a micro-batch's
    B * L stays <= max_tokens, except a single sequence longer than max_tokens, which gets a
    micro-batch of its own. Every sequence lands in exactly one micro-batch.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]), reverse=True)
    batches: list[PaddedBatch] = []
    current: list[int] = []
    for index in order:
        width = len(sequences[current[0]]) if current else len(sequences[index])
        if current and (len(current) + 1) * width > max_tokens:
            batches.append(_pad([sequences[i] for i in current], tuple(current), pad_id))
            current = []
        current.append(index)
    if current:
        batches.append(_pad([sequences[i] for i in current], tuple(current), pad_id))
    return batches
