"""Exact data parallelism for the PPO trainer over a torch.distributed process group.

``DataParallel`` says which worker this process is (rank of world_size) and does the few
collectives an optimizer step needs: summing gradients, summing metric totals and agreeing on a
skip. The trainer (``agent_core.training.trainer``) takes ``dp: DataParallel | None``; None (the
``SINGLE`` convention) is one process: today's behaviour with no collective at all.

Where this differs from ``torch.nn.parallel.DistributedDataParallel`` and why:

- The shard is a set of MICRO-BATCHES of one optimizer step, not a per-rank data loader. Every
  rank builds the same micro-batches and the same loss normalizers over the whole step
  (``agent_core.training.prepared``), runs forward + backward on ``shard`` of them, and the
  gradients are SUMMED (not averaged): each micro-batch loss is already divided by the step's
  global token/sequence counts, so the sum over ranks is exactly the 1-worker gradient for every
  loss aggregation mode. DDP averages per-rank means, which is exact only for equal-sized shards
  of a token mean, and ranks may hold different numbers of micro-batches here.
- Gradients are reduced once per optimizer step after all local micro-batches (like DDP's
  ``no_sync`` for accumulation), before gradient clipping, so every rank clips and steps the same.
- No module wrapping and no autograd hooks: the model stays a plain module (scoring, checkpoints
  and the critic work unchanged), and a rank with no micro-batch, or a parameter no rank used,
  still takes part in the same collectives in the same order.
- The skip decision (a non-finite loss or output on any rank) is agreed by a collective, so the
  ranks never diverge: either all step or none does.

Pure torch.distributed (gloo on CPU, NCCL on GPU); the launcher (torchrun, Ray, a test's spawn)
creates the process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

SINGLE = None  # dp=SINGLE (None): one process, no collectives


@dataclass(frozen=True)
class DataParallel:
    """This process's place among `world_size` data-parallel workers of `group` (None: the default group)."""

    rank: int
    world_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank} of {self.world_size}")

    @classmethod
    def from_process_group(cls, group: Any = None) -> "DataParallel":
        """This process's rank and world size in `group` of the initialized default process group."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DataParallel.from_process_group needs an initialized torch.distributed process "
                               "group: call torch.distributed.init_process_group(...) first (torchrun sets the "
                               "environment for it), or pass dp=None to train in one process")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's items, round robin (rank, rank + world_size, ...): neighbours differ most in size."""
        return list(items)[self.rank::self.world_size]

    def _device(self) -> torch.device:
        # NCCL reduces only CUDA tensors; gloo (and others) take CPU tensors.
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def sum_floats(self, values: list[float]) -> list[float]:
        """Each value summed over all ranks (one all_reduce of a float64 tensor)."""
        if self.world_size == 1 or not values:
            return [float(v) for v in values]
        buffer = torch.tensor(values, dtype=torch.float64, device=self._device())
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
        return buffer.tolist()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank."""
        return self.sum_floats([1.0 if flag else 0.0])[0] > 0

    def all_reduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace each parameter's .grad by its sum over all ranks (one all_reduce per dtype/device).

        Every rank must pass the same parameters in the same order. A missing grad counts as zeros
        (a rank that ran no micro-batch still joins); a parameter that had no grad on ANY rank gets
        None back, as in one process, so the optimizer skips it exactly as it would there.
        """
        if self.world_size == 1:
            return
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:  # insertion order = parameter order: the same on every rank
            buckets.setdefault((p.device, p.dtype), []).append(p)
        for bucket in buckets.values():
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, params: list[torch.nn.Parameter]) -> None:
        # One flat buffer: the gradients, then a 1/0 "had a grad" flag per parameter (summed with them).
        reference = params[0]
        flat = [torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if p.grad is None else p.grad.reshape(-1)
                for p in params]
        flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params], dtype=reference.dtype,
                             device=reference.device)
        buffer = torch.cat(flat + [flags])
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        had_grad = buffer[-len(params):] > 0
        for p, used in zip(params, had_grad.tolist()):
            summed = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if not used:
                p.grad = None
            elif p.grad is None:
                p.grad = summed.clone()
            else:
                p.grad.copy_(summed)
