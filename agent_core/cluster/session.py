"""The cluster a run uses, kept for the whole run: one Ray connection, one replica pool, one
group of training workers; `close_cluster` stops them all (the flow calls it when the run ends).

Stages reach the cluster only through `rollout_engine` and `train_on_cluster`, so the tasks read
the same with or without one (docs/scale-out.md).
"""

from __future__ import annotations

import threading

from agent_core.cluster.replicas import ReplicaPool, ReplicaSpec
from agent_core.cluster.router import ReplicaRouter
from agent_core.cluster.runtime import ClusterSpec, connect, disconnect
from agent_core.rollout.engines import router_concurrency
from agent_core.cluster.trainers import TrainerGroup, TrainerSpec
from agent_core.training.iteration import TrainJob

_lock = threading.Lock()
_pool: ReplicaPool | None = None
_trainers: TrainerGroup | None = None


def rollout_engine(cluster: ClusterSpec, spec: ReplicaSpec, policy_dir: str, version: int, *,
                   generate_timeout_s: float) -> ReplicaRouter:
    """A router over replicas that all serve `policy_dir` as `version` (started, or synced to it)."""
    global _pool
    connect(cluster)
    with _lock:
        if _pool is not None and _pool.spec != spec:  # another engine or size: start afresh
            _pool.shutdown()
            _pool = None
        if _pool is None:
            _pool = ReplicaPool(spec, policy_dir, version)
        else:
            _pool.sync(policy_dir, version)
        pool = _pool
    return ReplicaRouter(pool, generate_timeout_s=generate_timeout_s,
                         concurrent_calls=router_concurrency(spec.engine, spec.options, spec.size))


def train_on_cluster(cluster: ClusterSpec, spec: TrainerSpec, job: TrainJob):
    """`job` on `spec.workers` data-parallel workers (the group is started once per run); rank 0's outcome."""
    global _trainers
    connect(cluster)
    with _lock:
        if _trainers is not None and _trainers.spec != spec:
            _trainers.shutdown()
            _trainers = None
        if _trainers is None:
            _trainers = TrainerGroup(spec)
        trainers = _trainers
    try:
        return trainers.train(job)
    except BaseException:
        with _lock:  # a failed step stops the group (TrainerGroup.train): the next one starts afresh
            if _trainers is trainers:
                _trainers = None
        raise


def close_cluster() -> None:
    """Stop the replicas and the training workers, and leave Ray (a local cluster stops)."""
    global _pool, _trainers
    with _lock:
        pool, trainers, _pool, _trainers = _pool, _trainers, None, None
    try:
        if pool is not None:
            pool.shutdown()
        if trainers is not None:
            trainers.shutdown()
    finally:
        disconnect()
