"""One run's use of a Ray cluster: the connection, one replica pool, one group of training workers,
kept between stages and stopped by `ClusterSession.close` (RunResources, when the run ends).

Stages reach it only through their `Placement` (placement.py), so the tasks read the same with or
without a cluster (docs/scale-out.md).
"""

from __future__ import annotations

import threading

from agent_core.cluster.replicas import ReplicaPool, ReplicaSpec
from agent_core.cluster.router import ReplicaRouter
from agent_core.cluster.runtime import ClusterSpec, connect, disconnect
from agent_core.cluster.trainers import TrainerGroup, TrainerSpec
from agent_core.rollout.engines import router_concurrency
from agent_core.training.iteration import TrainJob


class ClusterSession:
    """The replicas and training workers of one run on `cluster`, started on first use."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self._lock = threading.Lock()  # an overlapping rollout and training use it from two threads
        self._pool: ReplicaPool | None = None
        self._trainers: TrainerGroup | None = None

    def rollout_engine(self, spec: ReplicaSpec, policy_dir: str, version: int, *,
                       generate_timeout_s: float) -> ReplicaRouter:
        """A router over replicas that all serve `policy_dir` as `version` (started, or synced to it)."""
        connect(self.cluster)
        with self._lock:
            if self._pool is not None and self._pool.spec != spec:  # another engine or size: start afresh
                self._pool.shutdown()
                self._pool = None
            if self._pool is None:
                self._pool = ReplicaPool(spec, policy_dir, version)
            else:
                self._pool.sync(policy_dir, version)
            pool = self._pool
        return ReplicaRouter(pool, generate_timeout_s=generate_timeout_s,
                             concurrent_calls=router_concurrency(spec.engine, spec.options, spec.size))

    def train(self, spec: TrainerSpec, job: TrainJob):
        """`job` on `spec.workers` data-parallel workers (the group is started once); rank 0's outcome."""
        connect(self.cluster)
        with self._lock:
            if self._trainers is not None and self._trainers.spec != spec:
                self._trainers.shutdown()
                self._trainers = None
            if self._trainers is None:
                self._trainers = TrainerGroup(spec)
            trainers = self._trainers
        try:
            return trainers.train(job)
        except BaseException:
            with self._lock:  # a failed step stops the group (TrainerGroup.train): the next one starts afresh
                if self._trainers is trainers:
                    self._trainers = None
            raise

    def close(self) -> None:
        """Stop the replicas and the training workers, and leave Ray (a local cluster stops)."""
        with self._lock:
            pool, trainers, self._pool, self._trainers = self._pool, self._trainers, None, None
        try:
            if pool is not None:
                pool.shutdown()
            if trainers is not None:
                trainers.shutdown()
        finally:
            disconnect()

    def __enter__(self) -> "ClusterSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
