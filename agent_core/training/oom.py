"""A micro-batch that runs out of device memory is split in two and retried, not a crashed run.

``run_with_splits`` runs a step's (micro-batch, masks) pairs. A forward pass that raises
``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is a subclass) has touched no
gradient: its micro-batch is split by rows (``prepared.split_rows``) and each half retried, down
to one row. Halves give the whole's gradient: every micro-batch loss is divided by normalizers
counted over the whole step (``prepared.Normalizers``), so losses add over rows. A backward pass
that runs out of memory has already added part of the micro-batch to some parameters' gradients
(autograd accumulates each parameter's gradient as soon as it is ready), so it cannot be retried
in place: ``backward`` turns it into ``PartialBackward`` and the trainer restarts the step from
zero gradients (``RestartStep``). Either way the budget halves (``TokenBudget``): the step's
later micro-batches, and the updates after it, run at the smaller size; ``splits`` counts the
events (``train_metrics.oom_splits``). The CUDA cache is emptied between tries, outside the
`except` clause (the exception's traceback holds the failed pass's tensors until it ends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, TypeVar

import torch

Pair = TypeVar("Pair", bound=tuple)


class MicroBatchOutOfMemory(RuntimeError):
    """One row alone does not fit in the device's memory."""


class PartialBackward(Exception):
    """The backward pass ran out of memory after some gradients took part of the micro-batch."""


class RestartStep(Exception):
    """The step's gradients hold part of a failed micro-batch: recompute them from zero."""


@dataclass
class TokenBudget:
    """Padded tokens per micro-batch, halved at each out-of-memory split (``splits`` counts them)."""

    tokens: int
    splits: int = 0

    def shrink(self, batch_tokens: int) -> None:
        self.tokens = max(1, min(self.tokens, batch_tokens) // 2)
        self.splits += 1


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()``; out of memory there raises ``PartialBackward`` (module docstring)."""
    try:
        loss.backward()
        return
    except torch.OutOfMemoryError:
        pass  # raised below, outside the clause: the failed pass's tensors go with its traceback
    raise PartialBackward("out of memory in the backward pass")


def free_cached_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _one_row_error(input_ids: torch.Tensor) -> MicroBatchOutOfMemory:
    return MicroBatchOutOfMemory(
        f"out of memory on {input_ids.device} training one sequence of {input_ids.shape[-1]} tokens alone; set "
        "trainer.activation_checkpointing: true or trainer.precision: bf16, use policy.lora, or shorten the "
        "episodes (rollout max tokens / turns)")


def run_with_splits(pairs: Sequence[Pair], step: Callable[..., torch.Tensor], budget: TokenBudget,
                    split: Callable[..., list[Pair]]) -> Iterator[torch.Tensor]:
    """`step(*pair)` for each pair, in order; yields each result. A pair with more than one row and
    more than `budget.tokens` padded tokens is split before it runs; one that runs out of memory
    in its forward pass is split and retried; ``PartialBackward`` becomes ``RestartStep`` (module
    docstring). One row that runs out of memory raises ``MicroBatchOutOfMemory``."""
    stack = list(reversed(pairs))
    while stack:
        pair = stack.pop()
        input_ids = pair[0].input_ids
        if input_ids.shape[0] > 1 and input_ids.numel() > budget.tokens:
            stack.extend(reversed(split(*pair)))
            continue
        failure = None
        try:
            result = step(*pair)
        except torch.OutOfMemoryError:
            failure = "forward"
        except PartialBackward:
            failure = "backward"
        if failure is None:
            yield result
            continue
        if input_ids.shape[0] == 1:
            raise _one_row_error(input_ids)
        budget.shrink(input_ids.numel())
        free_cached_memory(input_ids.device)
        if failure == "backward":
            raise RestartStep(f"out of memory in the backward pass of {input_ids.numel()} tokens")
        stack.extend(reversed(split(*pair)))
