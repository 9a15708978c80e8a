"""The run's placement, device memory and process-level resources, owned by one object for a run.

`RunResources` sets up, on entry, the run's device and `placement` (with its cluster session on a
cluster run), the run's disk budget (the free space every checkpoint, optimizer state and table write
leaves: io/disk_budget.py) and, when one process trains and generates, the engines' loan of the trainer's
resident policy (or of its inference copy in the engine's dtype); it frees, on exit, normal or not and
each step even if one before failed: the pooled engines, the cluster, the background writer (its queue
first), the resident policy and the lender, the shared BM25 indexes, the CUDA cache, then the budget.
Design notes: docs/architecture.md §11 (agent_core/run_resources.py).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch

from agent_core.cluster.placement import Placement
from agent_core.config import PipelineConfig
from agent_core.devices import resolve_device
from agent_core.envs.search import clear_shared_indexes
from agent_core.io import background, disk_budget
from agent_core.rollout import engines
from agent_core.rollout.inference_copy import CopyLease, InferenceCopy, parameter_dtype
from agent_core.training import resident

log = logging.getLogger(__name__)


class RunResources:
    """Context manager owning a run's device placement, colocation and process-level resources."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.device_setting = config.device
        self.device: torch.device | None = None  # resolved on entry
        where = Placement(config.cluster, config.device)
        # What the stages get: the run's placement, with the run's cluster session when it has a cluster.
        self.placement = replace(where, session=where.new_session()) if where.on_cluster else where
        # One process trains and generates: the engine may borrow the trainer's module.
        self.colocated = where.colocated(config.runtime.keep_policy_in_memory)
        self._stack: ExitStack | None = None
        self._copies: dict[torch.dtype, InferenceCopy] = {}  # the engines' bf16 copies of the policy (on CUDA)
        self._budget: ExitStack | None = None  # the run's disk margin, in force from entry to the very end

    def __enter__(self) -> "RunResources":
        self.device = resolve_device(self.device_setting)
        self._budget = ExitStack()
        margin = self.config.checkpoints.disk_margin_mb * disk_budget.MIB
        self._budget.enter_context(disk_budget.margin_for_run(margin, self.config.run_id))
        self._stack = ExitStack()
        if self.colocated:
            self._stack.enter_context(engines.lending(self._lend))
        return self

    def _lend(self, policy_dir: Path, device: torch.device, dtype: torch.dtype):
        """The resident policy itself when the engine samples in its dtype; else the run's inference copy
        of it in `dtype`, refreshed from it now (None while that copy is still in use: the engine loads)."""
        lease = resident.lend(policy_dir, device)
        if lease is None or parameter_dtype(lease.model) == dtype:
            return lease
        try:
            if dtype not in self._copies:
                self._copies[dtype] = InferenceCopy(dtype)
            module = self._copies[dtype].refresh(lease.model)
        finally:
            lease.release()  # the copy is the engine's: the trainer may take its module back at once
        return None if module is None else CopyLease(module, lease.tokenizer, self._copies[dtype])

    def after_rollout(self) -> None:
        """Between a rollout and the training after it: give the allocator's cached blocks (the
        engine's KV cache, freed when it closed) back to the device for the trainer (CUDA only)."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __exit__(self, kind, error, traceback) -> None:
        failures: list[BaseException] = []

        def step(what: str, action) -> None:
            try:
                action()
            except BaseException as failure:  # each resource is freed even if one before it failed
                log.error("freeing the run's %s failed: %s: %s", what, type(failure).__name__, failure)
                failures.append(failure)

        step("engines", engines.shutdown_engines)
        if self.placement.session is not None:
            step("cluster", self.placement.session.close)
        step("background writer", background.close)  # before forgetting: its last job may keep the policy
        step("resident policy", self._drop_resident)
        step("search indexes", clear_shared_indexes)
        if self.device is not None and self.device.type == "cuda":
            step("CUDA cache", torch.cuda.empty_cache)
        if self._budget is not None:  # last: whatever the steps above still write is under the run's margin
            step("disk budget", self._budget.close)
            self._budget = None
        if failures and error is None:
            raise failures[0]

    def _drop_resident(self) -> None:
        try:
            if self._stack is not None:
                self._stack.close()  # the engines' lender
        finally:
            self._stack = None
            for inference_copy in self._copies.values():
                inference_copy.close()
            self._copies.clear()
            resident.forget()
