"""Where a run's work runs: this process, or the Ray cluster its `cluster` section names.

One `Placement` per run answers every "in this process?" question (the rollout engine, training,
colocation of the two) and builds the rollout engine either way, so stages read the same with or
without a cluster (docs/scale-out.md). The run's `RunResources` makes it, with the run's cluster
session (its replicas and workers, kept between stages); a placement without one (a stage run on its
own) opens a session for the stage. Ray is imported only when the cluster is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from agent_core.config import ClusterConfig, RolloutConfig
from agent_core.devices import resolve_device
from agent_core.plugins import loaded_plugins
from agent_core.rollout.engine import Engine
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine
from agent_core.training.iteration import TrainJob, run_training

if TYPE_CHECKING:
    from agent_core.cluster.session import ClusterSession


@dataclass(frozen=True)
class Placement:
    """cluster: the run's cluster section (None or an unset address: everything in this process).
    device: the run's `device` setting, resolved where a model loads (agent_core/devices.py).
    session: the run's cluster session (`new_session`, owned and closed by RunResources); None: each
    stage that needs the cluster opens and closes its own."""

    cluster: ClusterConfig | None = None
    device: str = "auto"
    session: ClusterSession | None = field(default=None, compare=False, repr=False)

    @property
    def on_cluster(self) -> bool:
        """Whether rollouts go to Ray replicas (unset address: this process)."""
        return self.cluster is not None and self.cluster.address is not None

    @property
    def trains_in_process(self) -> bool:
        """Whether training runs in this process (else on data-parallel Ray workers)."""
        return not self.on_cluster or self.cluster.trainer_workers == 1 and self.cluster.worker_gpus == 0

    def colocated(self, keep_policy_in_memory: bool) -> bool:
        """Whether one process trains and generates, so an engine may borrow the trainer's module."""
        return keep_policy_in_memory and not self.on_cluster

    def training_device(self) -> torch.device:
        """Where the policy trains: the run's device here; a data-parallel worker's own (a GPU when
        cluster.worker_gpus > 0)."""
        if self.trains_in_process:
            return resolve_device(self.device)
        return torch.device("cuda" if self.cluster.worker_gpus > 0 and self.device != "cpu" else "cpu")

    def new_session(self) -> ClusterSession:
        """A session on this placement's cluster (nothing starts until a stage uses it)."""
        from agent_core.cluster.session import ClusterSession

        return ClusterSession(self._cluster_spec())

    def job_device(self) -> str:
        """The device setting a training job carries: the run's here; for a worker, cpu or auto (its
        own GPU when Ray gave it one: an index of this machine means nothing there)."""
        return self.device if self.trains_in_process or self.device == "cpu" else "auto"

    @contextmanager
    def rollout_engine(self, rollout: RolloutConfig, policy_dir: str, version: int) -> Iterator[Engine]:
        """The rollout's engine, closed on exit: in-process from the registry, or a router over the
        cluster's replicas, all serving `policy_dir` as `version` before the first call."""
        with ExitStack() as stack:
            if self.on_cluster:
                engine = self._router(stack.enter_context(self._session()), rollout, policy_dir, version)
            else:
                engine = ENGINES.get(rollout.engine)(Path(policy_dir), EngineOptions.from_rollout(rollout, self.device))
            try:
                yield engine
            finally:
                close_engine(engine)

    def train(self, job: TrainJob):
        """Run `job` here, or on the cluster's data-parallel workers (started once per run); the outcome."""
        if self.trains_in_process:
            return run_training(job)
        from agent_core.cluster.trainers import TrainerSpec

        cluster = self.cluster
        spec = TrainerSpec(workers=cluster.trainer_workers, cpus=cluster.worker_cpus, gpus=cluster.worker_gpus,
                           threads=max(1, int(cluster.worker_cpus)))
        with self._session() as session:
            return session.train(spec, job)

    @contextmanager
    def _session(self) -> Iterator[ClusterSession]:
        """The run's session, or one for this stage alone (closed after it)."""
        if self.session is not None:
            yield self.session
            return
        with self.new_session() as session:
            yield session

    def _router(self, session: ClusterSession, rollout: RolloutConfig, policy_dir: str, version: int):
        from agent_core.cluster.replicas import ReplicaSpec

        cluster = self.cluster  # each replica places its engine by its own GPUs (cluster.replica_gpus)
        spec = ReplicaSpec(engine=rollout.engine, options=EngineOptions.from_rollout(rollout),
                           count=cluster.rollout_replicas, urls=cluster.replica_urls, cpus=cluster.replica_cpus,
                           gpus=cluster.replica_gpus, threads=max(1, int(cluster.replica_cpus)),
                           plugins=loaded_plugins(), sync_timeout_s=cluster.sync_timeout_s,
                           start_timeout_s=rollout.vllm.startup_timeout_s + 120)
        return session.rollout_engine(spec, policy_dir, version, generate_timeout_s=cluster.generate_timeout_s)

    def _cluster_spec(self):
        from agent_core.cluster.runtime import ClusterSpec

        return ClusterSpec(self.cluster.address, self.cluster.num_cpus, self.cluster.num_gpus)
