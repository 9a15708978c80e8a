"""The prune stage: after iteration k is committed, evaluated, registered and audited, apply the
`checkpoints:` retention rules to the run (agent_core/io/retention.py) and to its registered model
versions. Its own recorded step: a kill during it leaves tombstones and hidden temporaries that a
resume reads and sweeps, then the stage runs again and finishes (docs/reliability.md)."""

from __future__ import annotations

from agent_core.config import CheckpointsConfig
from agent_core.io import background
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.registry_retention import prune_registered_versions
from agent_core.io.retention import apply_prune, plan_prune
from tasks._common import completed_outputs, stage_logger, stage_task


@stage_task(name="prune")
def prune_checkpoints(run: RunLayout, iteration: int, policy: CheckpointsConfig, tracking_uri: str | None = None,
                      model_name: str | None = None, resume: bool = True) -> int:
    """Prune what `policy` lets go once iteration `iteration` is committed; the bytes freed. With
    `tracking_uri` and `model_name`, the run's registered versions of pruned iterations go too (the
    newest registered one always stays, so `models:/<name>@latest` and `@best` load)."""
    log = stage_logger("prune")
    background.wait()  # the train manifest (the commit pruning waits for) may still be queued
    record = StageRecord(run.manifest_path("prune", iteration), "prune",
                         inputs={"train": run.manifest_path("train", iteration)}, params={"checkpoints": policy})
    if completed_outputs(record, resume, f"iteration {iteration} pruning") is not None:
        return 0
    plan = apply_prune(plan_prune(run, policy))  # the files first: their registered links still count as kept ...
    freed = plan.bytes
    if tracking_uri and model_name and not policy.keep_all:  # ... so a version's bytes are counted here, once
        versions = prune_registered_versions(tracking_uri, model_name, run.run_id, set(plan.kept))
        freed += sum(version.bytes_freed for version in versions)
    record.commit({}, metrics={"bytes_freed": float(freed)})
    if plan.items:
        pruned = ", ".join(f"{item.kind} of " + ("the run" if item.iteration < 0 else f"iteration {item.iteration}")
                           for item in plan.items)
        log.info("iteration %d: pruned %s; %.1f MB freed (checkpoints kept: %s)", iteration, pruned, freed / 1e6,
                 ", ".join(f"{k} ({why})" for k, why in sorted(plan.kept.items()) if k >= 0))
    return freed
