"""Stage 6 (after each iteration's training): the behaviour health audit (issue 33).

Reads the run's tables through the read-only SQL catalog, runs every check (agent_core/audit),
validates and writes the iteration's `health` table, logs each check's value to MLflow
(`health.<check>`, and `health.alerts`), publishes the failing checks as a Prefect artifact and in
the run's report folder (`report/health.md`), and prints one console line. With `audit.on_alert:
stop`, an iteration that alerts asks the flow to end the run (`AuditResult.stop`).

A resumed run does not stop again on an iteration whose audit completed before (its manifest
matches): the alert was acted on once, and the resume is the user's answer to it. A changed
`audit:` section reruns the audit of every iteration with the new settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from prefect.artifacts import create_markdown_artifact

from agent_core.audit import HealthRow, audit_iterations, judged_iterations
from agent_core.audit.report import health_markdown, write_health_report
from agent_core.config.audit import AuditConfig
from agent_core.io.layout import RUN_TABLES, RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.run_catalog import health_uri
from agent_core.io.tables import read_table, write_table
from agent_core.io.tracking import Tracker
from tasks._common import completed_outputs, stage_logger, stage_task


@dataclass(frozen=True)
class AuditResult:
    iteration: int
    health_uri: str | None  # None: the audit is disabled
    alerts: list[str] = field(default_factory=list)  # one line per failing check
    failing_checks: list[str] = field(default_factory=list)
    stop: bool = False  # on_alert is stop and this (fresh) audit alerted

    @property
    def reason(self) -> str:
        """One short line for `agentr1 runs`: the failing checks (their values: report/health.md)."""
        return f"audit alert at iteration {self.iteration}: {', '.join(self.failing_checks)} (report/health.md)"


def _log_metrics(tracking: Any, iteration: int, rows) -> None:
    """`tracking`: the flow's TrackingRef (tasks/track.py), read by its fields (tasks share no modules)."""
    if tracking is None:
        return
    metrics = {f"health.{r.check_name}": r.value for r in rows if r.value is not None}
    metrics["health.alerts"] = float(sum(r.failing for r in rows))
    Tracker(tracking.tracking_uri, tracking.artifact_location, tracking.experiment).log_metrics(
        tracking.mlflow_run_id, metrics, step=iteration)


def _inputs(run: RunLayout, iteration: int, baseline_iterations: int) -> dict[str, str]:
    """The tables the iteration's verdict depends on, exactly those the audit reads: its own and the
    baseline iterations' (agent_core/audit/runner.py judged_iterations)."""
    return {f"{name}@{k}": run.table_uri(k, name) for k in sorted(judged_iterations([iteration], baseline_iterations))
            for name in RUN_TABLES}


@stage_task(name="audit")
def audit_iteration(run: RunLayout, iteration: int, cfg: AuditConfig, tracking: Any = None,
                    resume: bool = True, offers_tools: bool = True) -> AuditResult:
    """`offers_tools`: the run's env gives the policy tools (False: the tool checks are not run)."""
    if not cfg.enabled:
        return AuditResult(iteration, None)
    uri = health_uri(run, iteration)
    record = StageRecord(run.manifest_path("audit", iteration), "audit",
                         inputs=_inputs(run, iteration, cfg.baseline_iterations),
                         params={"audit": cfg, "offers_tools": offers_tools})
    done = completed_outputs(record, resume, f"iteration {iteration} audit") is not None
    # audited before with these tables and settings: its verdict is read back, not recomputed
    rows = ([HealthRow(**row) for row in read_table("health", uri).to_pylist()] if done
            else audit_iterations(run, cfg, [iteration], offers_tools))
    failing = [r for r in rows if r.failing]
    stop = bool(failing) and cfg.on_alert == "stop" and not done
    log = stage_logger("audit")
    if not done:
        write_table("health", [r.row() for r in rows], uri)
        _log_metrics(tracking, iteration, rows)
        write_health_report(run)
        if failing:
            create_markdown_artifact(markdown=health_markdown(run.run_id, failing), key=_artifact_key(run.run_id),
                                     description=f"agentr1 run {run.run_id}: failing health checks")
        record.commit({"health": uri})
    if failing:
        log.warning("audit of iteration %d: %d of %d checks fail (%s): %s", iteration, len(failing), len(rows),
                    "stopping the run" if stop else "audited before, not stopping again" if done and
                    cfg.on_alert == "stop" else "on_alert: warn",
                    "; ".join(r.line() for r in failing))
    else:
        log.info("audit of iteration %d: %d checks, none fails", iteration, len(rows))
    return AuditResult(iteration, uri, [r.line() for r in failing], [r.check_name for r in failing],
                       stop=stop)


def _artifact_key(run_id: str) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes only."""
    return "agentr1-health-" + re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
