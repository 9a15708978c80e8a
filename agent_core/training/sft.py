"""Supervised fine-tuning on recorded steps: the warm start before RL.

A small model first learns the tool format and the task's moves by imitating successful episodes
(from a scripted oracle agent, or earlier runs selected by SQL), then improves by RL. The loss is
the mean negative log-likelihood of the action tokens (the action mask: prompt, observation and
template-glue tokens are context, never targets), token-mean over each optimizer step, with the
same token-budgeted micro-batches, gradient clipping and non-finite guard as the PPO trainer.
With `all_tokens=True` every predicted token is a target (language modelling on the whole episode,
passages included): a from-scratch model learns to copy a name it has just read from the repeated
names in passages far sooner than from the few action tokens alone (measured on the built-in task:
see docs/results.md). The RL masks are unaffected; this is the warm start's objective only.

Where this differs from Agent-R1: the paper starts RL from instruct models that already follow a
tool format; a from-scratch CPU-scale model needs this warm start to produce any reward at all.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from agent_core.algos.masks import predicted_token_mask
from agent_core.training.batches import TrainSequence, make_micro_batches
from agent_core.training.scoring import model_vocab_size, sequence_logprobs, vocab_capped_tokens


@dataclass(frozen=True)
class SftResult:
    """One optimizer step: mean NLL per action token, tokens, grad norm; skipped when not finite."""

    epoch: int
    nll: float
    tokens: int
    grad_norm: float
    seconds: float
    skipped: bool


def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sequences: Sequence[TrainSequence], *,
             pad_id: int, micro_batch_tokens: int, max_grad_norm: float | None, epoch: int = 0,
             all_tokens: bool = False) -> SftResult:
    """One optimizer step of token-mean NLL over the action tokens (or all predicted tokens) of `sequences`."""
    started = time.perf_counter()
    device = next(model.parameters()).device
    max_tokens = vocab_capped_tokens(micro_batch_tokens, model_vocab_size(model))
    batches = [b.to(device) for b in make_micro_batches(sequences, max_tokens=max_tokens, pad_id=pad_id)]
    targets = [(predicted_token_mask(b.attention_mask) if all_tokens else b.action_mask * b.attention_mask).float()
               for b in batches]
    total_tokens = float(sum(t.sum() for t in targets))
    if total_tokens == 0:
        raise ValueError("sft_step: the sequences have no action tokens to learn")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    nll_sum = 0.0
    for batch, target in zip(batches, targets):
        logprobs, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, entropy_grad=False,
                                        right_padded=True)
        loss = -(logprobs * target).sum() / total_tokens  # micro-batch share of the step's token mean
        loss.backward()
        nll_sum += float(loss.detach())
    params = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf")))
    skipped = not (math.isfinite(nll_sum) and math.isfinite(norm))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return SftResult(epoch, nll_sum, int(total_tokens), norm, time.perf_counter() - started, skipped)


def sft_train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sequences: Sequence[TrainSequence], *,
              pad_id: int, epochs: int, batch_size: int, micro_batch_tokens: int, max_grad_norm: float | None = 1.0,
              seed: int = 0, log_every: int = 0, log=None, all_tokens: bool = False) -> list[SftResult]:
    """`epochs` shuffled passes over `sequences`, one optimizer step per `batch_size` sequences."""
    if not sequences:
        raise ValueError("sft_train needs at least one sequence")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    rng = random.Random(seed)
    order = list(range(len(sequences)))
    total = epochs * -(-len(order) // batch_size)
    results = []
    for epoch in range(epochs):
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            chosen = [sequences[i] for i in order[start:start + batch_size]]
            results.append(sft_step(model, optimizer, chosen, pad_id=pad_id, micro_batch_tokens=micro_batch_tokens,
                                    max_grad_norm=max_grad_norm, epoch=epoch, all_tokens=all_tokens))
            if log is not None and log_every and len(results) % log_every == 0:
                log.info("warm start: epoch %d, step %d of %d, NLL per %s token %.3f", epoch, len(results), total,
                         "predicted" if all_tokens else "action", results[-1].nll)
    return results
