"""Induction pretraining: the one skill a from-scratch policy needs before it can imitate a tool agent.

A pretrained language model can already copy: given "... Ann Lee ... <search>", it continues with
"Ann Lee" because it has induction heads (attention that finds an earlier occurrence of the current
context and copies what followed). A tiny model built from scratch has none, and learning them
from the warm start's few action tokens alone is a long plateau: measured on the built-in task
(4 layers x 128 hidden, 2 CPU cores), 1,400 supervised steps left every search query a name seen
in training, never the one in the question (docs/results.md). A few hundred steps of this task
first, then the same warm start copies names it has never seen within ~250 steps.

The task: a random span of ordinary tokens, a separator, the same span again; the loss is on the
repeat only (the first half is unpredictable noise). It knows nothing about the task, the tools or
the data; it only gives the model the copying circuit a pretrained model brings. Where this differs
from Agent-R1: the paper starts from instruct models (Qwen2.5), which learned this in pretraining.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from agent_core.training.trainer import make_optimizer


@dataclass(frozen=True)
class PretrainResult:
    """How the pretraining went: steps, mean loss and copy accuracy over the last tenth of the steps."""

    steps: int
    final_loss: float
    final_accuracy: float
    seconds: float


def copy_batch(token_ids: torch.Tensor, separator_id: int, batch_size: int, span: int,
               generator: torch.Generator) -> torch.Tensor:
    """[batch_size, 2 * span + 1] int64: a random span of `token_ids`, `separator_id`, the span again."""
    picks = torch.randint(0, len(token_ids), (batch_size, span), generator=generator)
    first = token_ids[picks]
    separator = torch.full((batch_size, 1), separator_id, dtype=first.dtype)
    return torch.cat([first, separator, first], dim=1)


def induction_pretrain(model: torch.nn.Module, token_ids: Sequence[int], separator_id: int, *, steps: int,
                       lr: float = 1e-3, batch_size: int = 32, min_span: int = 4, max_span: int = 24, seed: int = 0,
                       log=None, log_every: int = 100) -> PretrainResult:
    """Train `model` (a causal LM, in place) for `steps` AdamW steps on the copy task (module docstring).

    token_ids: the ids spans are drawn from (ordinary tokens; special tokens are better left out).
    Each step draws one span length in [min_span, max_span] and `batch_size` spans of it.
    """
    if steps < 0 or batch_size < 1 or not 1 <= min_span <= max_span:
        raise ValueError(f"induction_pretrain: need steps >= 0, batch_size >= 1, 1 <= min_span <= max_span; got "
                         f"{steps}, {batch_size}, {min_span}, {max_span}")
    if len(token_ids) < 2:
        raise ValueError("induction_pretrain needs at least two token ids to draw spans from")
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    pool = torch.tensor(list(token_ids), dtype=torch.long)
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, lr=lr)
    tail = max(1, steps // 10)
    losses: list[float] = []
    accuracies: list[float] = []
    model.train()
    for step in range(steps):
        span = int(torch.randint(min_span, max_span + 1, (1,), generator=generator))
        batch = copy_batch(pool, separator_id, batch_size, span, generator).to(device)
        # logits at positions span .. 2*span-1 predict the repeated tokens span+1 .. 2*span
        logits = model(input_ids=batch).logits[:, span:-1].float()
        targets = batch[:, span + 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step >= steps - tail:
            losses.append(float(loss.detach()))
            accuracies.append(float((logits.argmax(-1) == targets).float().mean()))
        if log is not None and log_every and (step + 1) % log_every == 0:
            log.info("induction pretraining: step %d/%d, loss %.3f", step + 1, steps, float(loss.detach()))
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    mean = (lambda values: sum(values) / len(values) if values else float("nan"))
    return PretrainResult(steps, mean(losses), mean(accuracies), time.perf_counter() - started)
