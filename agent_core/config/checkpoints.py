"""The `checkpoints:` section: which iterations' files a run keeps, and the free space it insists on
before writing (agent_core/io/retention.py, agent_core/io/disk_budget.py; docs/reliability.md)."""

from __future__ import annotations

from pydantic import Field

from agent_core.config._base import Section


class CheckpointsConfig(Section):
    """Retention: the newest `keep_last` policy (and critic) checkpoints, every `keep_every`-th for good
    and the best by dev EM; optimizer states only for the newest committed iteration (what resume
    reads). Pruning runs after each iteration is committed and never touches what resume, a registered
    `best`/`latest` version or a running reader needs. `keep_all: true` keeps every file."""

    keep_all: bool = Field(False, description="keep every iteration's checkpoint, critic and optimizer states "
                           "(the behaviour before retention existed); the other keys are then ignored")
    keep_last: int = Field(1, ge=1, description="the newest N iterations' policy and critic checkpoints are kept "
                           "(the newest is what resume and the next rollout read, so at least 1)")
    keep_every: int = Field(0, ge=0, description="also keep every K-th iteration's checkpoint for good (iterations "
                            "K-1, 2K-1, ...); 0: none")
    keep_best: bool = Field(True, description="also keep the checkpoint with the highest dev EM (needs dev_eval; "
                            "ties: the later iteration)")
    disk_margin_mb: int = Field(256, ge=0, description="free space (MiB) that must remain after a checkpoint, "
                                "optimizer state or table is written; a write that would leave less stops the "
                                "run in one line before anything is written (agentr1 prune frees space)")
