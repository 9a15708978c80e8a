"""Exact data parallelism for the PPO trainer over a torch.distributed process group.

``DataParallel`` says which worker this process is (rank of world_size), which share of a step's micro-batches
it runs, and does the step's collectives: the gradient sum (torch's DDP with a SUM comm hook), summing metric
totals and agreeing on a skip. The shard is a set of micro-batches of one optimizer step, not a per-rank data
loader. The trainer takes ``dp: DataParallel | None``; None (``SINGLE``) is one process.
Design notes: docs/architecture.md §11 (agent_core/training/data_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

T = TypeVar("T")

SINGLE = None  # dp=SINGLE (None): one process, no collectives


def _sum_bucket(group, bucket):
    """DDP comm hook (state: the process group): the bucket's gradients SUMMED over ranks.

    DDP's default hook divides by the world size; this is default_hooks.allreduce_hook without the
    division. Returns a torch.futures.Future[torch.Tensor] holding the summed bucket. (Not
    annotated: DDP checks the annotations, which this module's postponed evaluation turns into
    strings.)
    """
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


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

    def sum_gradients(self, module: torch.nn.Module) -> None:
        """Replace the .grad of each trainable parameter of `module` by its sum over all ranks, through
        torch's DistributedDataParallel (module docstring); a no-op for one worker.

        Every rank calls it once per step with the same module (equal weights), after its local
        backward passes. `module` is a token model: ``module(input_ids=..., attention_mask=...)``
        (a causal LM, the critic's ValueModel); its output is not used. A missing grad counts as
        zeros (a rank that ran no micro-batch still joins); a parameter that had no grad on ANY
        rank gets None back, as in one process. The module's train/eval mode is kept.
        """
        params = [p for p in module.parameters() if p.requires_grad]  # DDP's parameters, in its order
        if self.world_size == 1 or not params:
            return
        had_grad = self.sum_floats([float(p.grad is not None) for p in params])
        device = params[0].device
        device_ids = None
        if device.type == "cuda":
            device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
        ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=self.group, init_sync=False,
                                      forward_sync_buffers=False)  # the buffers are equal: nothing to broadcast
        ddp.register_comm_hook(self.group, _sum_bucket)
        was_training = module.training
        module.eval()  # no dropout draw, no activation checkpointing: the output is thrown away
        try:
            with torch.enable_grad():
                token = torch.zeros(1, 1, dtype=torch.long, device=device)
                ddp(input_ids=token, attention_mask=torch.ones_like(token))  # arms DDP's reducer for one backward
                # One backward that reaches every parameter exactly once, adding zero: DDP's hooks
                # fire, and its buckets are all-reduced (summed) and copied back into .grad.
                torch.autograd.backward([p.sum() * 0 for p in params])
        finally:
            module.train(was_training)
        for p, count in zip(params, had_grad):
            if count == 0:
                p.grad = None
