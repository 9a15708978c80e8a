"""The weights an in-process engine samples with: the trainer's module itself, or a lower-precision copy of it.

On CUDA the trainer keeps fp32 master weights and runs its matmuls under bf16 autocast, so the
weights its log-probs assume are its parameters rounded to bf16. Sampling from the fp32 module
ran at half of bare bf16 `generate` (docs/benchmarks.md §GPU); sampling from a bf16 copy is as
fast and uses exactly those rounded weights. Only parameters are cast: buffers (rotary
frequencies) stay as the trainer has them. The copy is kept for the run and refreshed in place
(`copy_`, no new allocation) from the trainer's module before each rollout, so the device memory
it takes is allocated when the trainer sizes its micro-batches (agent_core/training/memory.py
reads free memory) and counted there.
"""

from __future__ import annotations

import copy
import threading

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def inference_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`rollout.hf.dtype` on `device`: auto is bfloat16 on CUDA (the trainer's autocast there) and
    float32 elsewhere (the CPU trainer computes in fp32)."""
    if setting == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if setting not in DTYPES:
        raise ValueError(f"unknown inference dtype {setting!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[setting]


def parameter_dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Floating-point parameters of `module` to `dtype`, in place; buffers untouched."""
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.is_floating_point() and parameter.dtype != dtype:
                parameter.data = parameter.data.to(dtype)
    return module


class InferenceCopy:
    """A `dtype` copy of a trained module, made on first use and refreshed in place after that.

    `refresh(source)` returns the copy holding `source`'s current parameters cast to `dtype`
    (a new copy when `source` has another structure). `in_use` counts open leases: a copy that an
    engine still samples with is never overwritten (`refresh` returns None; the caller loads).
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.module: torch.nn.Module | None = None
        self.refreshes = 0  # for tests and logs: how many times weights were copied in
        self._in_use = 0
        self._lock = threading.Lock()

    def refresh(self, source: torch.nn.Module) -> torch.nn.Module | None:
        with self._lock:
            if self._in_use:
                return None
            if self.module is None or not _same_structure(self.module, source):
                self.module = None  # the old copy's memory first
                self.module = cast_parameters(copy.deepcopy(source), self.dtype).requires_grad_(False)
            else:
                with torch.no_grad():
                    for target, parameter in zip(self.module.parameters(), source.parameters()):
                        target.copy_(parameter)
            self.refreshes += 1
            self._in_use += 1
            return self.module

    def release(self) -> None:
        with self._lock:
            self._in_use = max(0, self._in_use - 1)

    def close(self) -> None:
        """Free the copy (the run's end)."""
        with self._lock:
            self.module, self._in_use = None, 0


def _same_structure(copied: torch.nn.Module, source: torch.nn.Module) -> bool:
    ours = [(name, p.shape, p.device) for name, p in copied.named_parameters()]
    theirs = [(name, p.shape, p.device) for name, p in source.named_parameters()]
    return ours == theirs


class CopyLease:
    """An engine's lease on an `InferenceCopy`'s module (the Lease shape of agent_core/training/resident.py)."""

    def __init__(self, model: torch.nn.Module, tokenizer, owner: InferenceCopy):
        self.model, self.tokenizer, self._owner = model, tokenizer, owner

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()
