"""The run's device memory and process-level resources, owned by one object for the length of a run.

A training run in one process holds, besides its files: the trained policy, critic and optimizers
kept between iterations (agent_core/training/resident.py), warm engine processes (vLLM servers,
agent_core/rollout/engines.py), the background writer thread (agent_core/io/background.py), a Ray
session with its replicas and workers when `cluster.address` is set (agent_core/cluster/session.py),
and the BM25 indexes shared by rollouts (agent_core/envs/search.py). `RunResources` is the one place
that sets them up and frees them; the flow opens it once (`with RunResources(config) as resources:`).

Placement and colocation, on entry: `device` is the run's `device` setting resolved once
(agent_core/devices.py), and the string the stages pass on (`resources.device_setting`). With
runtime.keep_policy_in_memory and training in this process, hf engines borrow the trainer's resident
policy (`engines.lending(resident.lend)`): one copy of the weights on the device, no reload per
rollout; the module generates in eval mode without autograd and goes back to the trainer as it came.
Where the engine samples in another dtype than the trainer keeps (bf16 on CUDA, rollout.hf.dtype), it
gets the run's inference copy of the policy instead, refreshed from the resident module before each
rollout (agent_core/rollout/inference_copy.py); the copy is freed with the resident policy.

Between rollout and training, `after_rollout` hands cached device memory back (the engine's KV
cache is garbage once it is closed), so the trainer's micro-batches get it.

On exit, in this order, whether the block ended normally or by an exception:
1. engines: pooled vLLM servers stop (their device memory first, it is the largest);
2. the cluster: replicas, training workers, a local Ray (only when cluster.address is set);
3. the background writer: its queue finishes (its last job may hold the policy in memory again),
   then its thread stops;
4. the resident policy, critic and optimizers, and the engines' lender, are dropped;
5. the shared BM25 indexes are dropped; then the CUDA allocator's cache is emptied (on CUDA).
Each step runs even if one before it failed; the first failure is raised after them, unless the
block is already raising (then it is logged).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch

from agent_core.cluster.placement import Placement
from agent_core.config import PipelineConfig
from agent_core.devices import resolve_device
from agent_core.envs.search import clear_shared_indexes
from agent_core.io import background
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
        self.placement = Placement(config.cluster, config.device)
        # One process trains and generates: the engine may borrow the trainer's module.
        self.colocated = self.placement.colocated(config.runtime.keep_policy_in_memory)
        self._stack: ExitStack | None = None
        self._copies: dict[torch.dtype, InferenceCopy] = {}  # the engines' bf16 copies of the policy (on CUDA)

    def __enter__(self) -> "RunResources":
        self.device = resolve_device(self.device_setting)
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
        if self.placement.on_cluster:
            from agent_core.cluster.session import close_cluster  # Ray: imported only for a cluster run

            step("cluster", close_cluster)
        step("background writer", background.close)  # before forgetting: its last job may keep the policy
        step("resident policy", self._drop_resident)
        step("search indexes", clear_shared_indexes)
        if self.device is not None and self.device.type == "cuda":
            step("CUDA cache", torch.cuda.empty_cache)
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
