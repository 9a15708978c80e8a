"""The `cluster:` section: where the work runs (docs/scale-out.md)."""

from __future__ import annotations

from pydantic import Field

from agent_core.config._base import Section


class ClusterConfig(Section):
    """Where the work runs (docs/scale-out.md). address unset: everything in this process (no Ray);
    `local`: start a Ray cluster here with num_cpus / num_gpus; `auto` or `ray://host:port`: join one."""

    address: str | None = Field(None, pattern=r"^(local|auto|ray://.+)$", description="unset, local, auto or ray://host:port")
    num_cpus: int | None = Field(None, ge=1, description="local: CPUs Ray may schedule (default: all)")
    num_gpus: int | None = Field(None, ge=0, description="local: GPUs Ray may schedule (default: all)")
    rollout_replicas: int = Field(1, ge=1, description="inference replicas, each an actor owning one engine")
    replica_urls: tuple[str, ...] = Field((), description="external OpenAI-compatible servers (vllm engine): one replica each")
    replica_cpus: float = Field(1.0, gt=0, description="CPUs reserved per replica actor")
    replica_gpus: float = Field(0.0, ge=0, description="GPUs reserved per replica actor")
    generate_timeout_s: float = Field(300.0, gt=0, description="a replica that takes longer on one call is taken out")
    sync_timeout_s: float = Field(300.0, gt=0, description="how long a replica may take to load new weights")
    trainer_workers: int = Field(1, ge=1, description="data-parallel training workers (torch.distributed)")
    worker_cpus: float = Field(1.0, gt=0, description="CPUs reserved per training worker")
    worker_gpus: float = Field(0.0, ge=0, description="GPUs per training worker (NCCL when > 0, else gloo)")
