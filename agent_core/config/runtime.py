"""The `runtime:` section: how the pipeline runs its work, never what it computes. Every switch
here leaves a run's tables and checkpoints the same (max_staleness: the same when 0); they trade
memory, time and overlap (docs/architecture.md §8, docs/scale-out.md)."""

from __future__ import annotations

from pydantic import Field

from agent_core.config._base import Section


class RuntimeConfig(Section):
    """Overlap and caching between stages: how stale a trained step may be, whether the trained
    policy stays in memory, whether the optimizer state is written in the background."""

    max_staleness: int = Field(0, ge=0, description="policy versions a trained step may lag its iteration (0: on-policy; "
                               "1: rollout k+1 overlaps training k, docs/scale-out.md); older steps are refused")
    keep_policy_in_memory: bool = Field(
        True, description="keep the trained policy, critic and optimizers in memory for the next iteration instead of "
        "reloading the checkpoint just written (still written every iteration; one process only, not "
        "data-parallel workers; same parameters either way)")
    background_save: bool = Field(
        True, description="write the optimizer state and the train stage's manifest on a background thread while the "
        "next rollout runs (the checkpoint is written before the stage returns; one process only)")
