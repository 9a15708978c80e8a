"""Data-parallel training workers: W Ray actors in one placement group, joined by a
torch.distributed process group (gloo on CPU, NCCL on GPU) (docs/scale-out.md).

Ray places and supervises the processes; torch.distributed moves the gradients
(agent_core/training/data_parallel.py). The group outlives an iteration, so the process group is
set up once per run (~3 s), not per training stage. Every worker runs the same
`run_training(job, dp)`; rank 0 writes the checkpoint.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from agent_core.cluster.runtime import ClusterError, kill_quietly, ray_module
from agent_core.failpoints import failpoint_environment
from agent_core.training.iteration import TrainJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerSpec:
    workers: int
    cpus: float = 1.0
    gpus: float = 0.0
    threads: int = 1
    start_timeout_s: float = 120.0


class TrainerWorker:
    """The body of one training worker actor."""

    def __init__(self, rank: int, world_size: int, threads: int, env: dict[str, str]):
        import torch

        os.environ.update(env)
        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size

    def address(self) -> tuple[str, int]:
        """This worker's host and a free port there (rank 0's is the rendezvous)."""
        ray = ray_module()
        with socket.socket() as probe:
            probe.bind(("", 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]

    def join(self, host: str, port: int, backend: str) -> int:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                    world_size=self.world_size)
        return dist.get_rank()

    def train(self, job: TrainJob):
        from agent_core.training.data_parallel import DataParallel
        from agent_core.training.iteration import run_training

        return run_training(job, DataParallel.from_process_group())

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """`spec.workers` TrainerWorker actors placed together, one process group among them."""

    def __init__(self, spec: TrainerSpec):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = ray_module()
        self.spec = spec
        bundle = {"CPU": spec.cpus, **({"GPU": spec.gpus} if spec.gpus else {})}
        self.placement = placement_group([bundle] * spec.workers, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=spec.start_timeout_s)
        except Exception:
            ray.util.remove_placement_group(self.placement)
            raise ClusterError(f"the cluster has no room for {spec.workers} training workers of {bundle} "
                               f"(resources: {ray.available_resources()})") from None
        actor_class = ray.remote(TrainerWorker)
        self.workers = [
            actor_class.options(num_cpus=spec.cpus, num_gpus=spec.gpus, max_restarts=0,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)
                                ).remote(rank, spec.workers, spec.threads, failpoint_environment())
            for rank in range(spec.workers)]
        try:
            host, port = ray.get(self.workers[0].address.remote(), timeout=spec.start_timeout_s)
            backend = "nccl" if spec.gpus else "gloo"
            ray.get([w.join.remote(host, port, backend) for w in self.workers], timeout=spec.start_timeout_s)
        except Exception as error:
            self.shutdown()
            raise ClusterError(f"training workers could not form a process group: {error}") from None
        log.info("%d training workers joined (%s)", spec.workers, backend)

    def train(self, job: TrainJob):
        """Run `job` on every worker; rank 0's (results, rows). A worker's error is raised as itself,
        at once: the group is stopped first, since the other workers may wait in a collective for it."""
        ray = ray_module()
        pending = {w.train.remote(job): rank for rank, w in enumerate(self.workers)}
        outcomes = {}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                outcomes[pending.pop(done[0])] = ray.get(done[0])
        except BaseException:
            self.shutdown()
            raise
        return outcomes[0]

    def shutdown(self) -> None:
        ray = ray_module()
        try:
            ray.get([w.leave.remote() for w in self.workers], timeout=30)
        except Exception:  # killed below all the same
            pass
        for worker in self.workers:
            kill_quietly(worker)
        ray.util.remove_placement_group(self.placement)
