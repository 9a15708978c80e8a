"""Joining or starting the Ray cluster a run uses, and leaving it (docs/scale-out.md).

Ray is an optional extra (`pip install -e ".[ray]"`): nothing here imports it until a config
names a cluster, so the default, in-process pipeline stays Ray-free. `local` starts a private Ray
instance for this process (no dashboard; stopped again by `disconnect`); `auto` and
`ray://host:port` join a running cluster, which `disconnect` leaves running.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

RAY_TEMP_DIR_ENV = "AGENTR1_RAY_TEMP_DIR"  # where a local cluster keeps its session folders (sockets: keep it short)
_OBJECT_STORE_BYTES = 256 * 1024**2  # episodes and token ids only; Ray's default takes 30% of RAM


class ClusterError(RuntimeError):
    """The cluster cannot be used: Ray missing, no replica left, a sync that timed out."""


@dataclass(frozen=True)
class ClusterSpec:
    """Where Ray runs: address `local`, `auto` or `ray://host:port`; num_cpus / num_gpus size a local one."""

    address: str
    num_cpus: int | None = None
    num_gpus: int | None = None


_state_lock = threading.Lock()
_owned = False  # this module started (or joined) the connection, so it ends it; a caller's own ray.init stays


def ray_module():
    """The `ray` package, or a ClusterError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ClusterError('cluster.address is set but Ray is not installed: pip install -e ".[ray]" '
                           "(make test-slow and the scale-out targets install it)") from None
    return ray


def connect(spec: ClusterSpec) -> None:
    """Join or start the cluster (once per process; a no-op while connected, e.g. when the caller
    ran ray.init itself: then `disconnect` leaves that connection alone)."""
    global _owned
    ray = ray_module()
    with _state_lock:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # 2.60 warns about token auth on every local start
        common = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=True)
        if spec.address == "local":
            temp_dir = os.environ.get(RAY_TEMP_DIR_ENV)
            ray.init(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, object_store_memory=_OBJECT_STORE_BYTES,
                     **({"_temp_dir": temp_dir} if temp_dir else {}), **common)
        else:
            try:
                ray.init(address=spec.address, **common)
            except (ConnectionError, RuntimeError) as error:
                raise ClusterError(f"cannot join the Ray cluster at {spec.address!r}: {error}") from None
        _owned = True
        resources = ray.cluster_resources()
        log.info("Ray cluster %s: %s CPUs, %s GPUs", spec.address, resources.get("CPU", 0), resources.get("GPU", 0))


def disconnect() -> None:
    """Leave the cluster `connect` joined; a local one stops with every process it started."""
    global _owned
    try:
        import ray
    except ImportError:
        return
    with _state_lock:
        if _owned and ray.is_initialized():
            ray.shutdown()
        _owned = False


def kill_quietly(actor) -> None:
    """Stop an actor now (a dead one already is)."""
    ray = ray_module()
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone: nothing to stop
        pass
