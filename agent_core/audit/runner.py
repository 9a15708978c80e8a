"""Running the audit over a run's tables: the checks of a config, through the read-only catalog of
`agentr1 query` (agent_core/io/run_catalog.py), judged per iteration (agent_core/audit/evaluate.py)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from agent_core.audit.checks import Check, configured_checks
from agent_core.audit.evaluate import HealthRow, run_checks
from agent_core.config.audit import AuditConfig
from agent_core.io.layout import RUN_TABLES, RunLayout
from agent_core.io.run_catalog import open_run_catalog, select_values
from agent_core.io.tables import table_exists


def tables_read(check: Check) -> list[str]:
    """The run tables a check's SQL names (a word match: good enough to say which file is missing)."""
    return [name for name in RUN_TABLES if re.search(rf"\b{name}\b", check.sql, re.IGNORECASE)]


def _missing(run: RunLayout):
    def missing(check: Check, iteration: int) -> str | None:
        gone = [f"{name} ({run.table_uri(iteration, name)})" for name in tables_read(check)
                if not table_exists(run.table_uri(iteration, name))]
        return f"missing table {', '.join(gone)} of iteration {iteration}" if gone else None
    return missing


def judged_iterations(iterations: Sequence[int], baseline_iterations: int) -> set[int]:
    """The iterations whose tables judging `iterations` reads: those, and the baseline ones before
    the last of them (evaluate.py: a value is judged against the baseline iterations' mean)."""
    return {*iterations, *range(min(baseline_iterations, max(iterations)))}


def audit_iterations(run: RunLayout, cfg: AuditConfig, iterations: Sequence[int],
                     offers_tools: bool = True) -> list[HealthRow]:
    """The health rows of `iterations` (each check judged at each), read from the run's tables of
    those and the baseline iterations only; the checks about tools only when `offers_tools` (the
    run's env gives the policy tools: agent_core.envs.registry.env_offers_tools). Never raises for a
    table: a check that cannot run, or runs past `audit.check_timeout_s`, is an `error` row."""
    if not iterations:
        return []
    with open_run_catalog(run, judged_iterations(iterations, cfg.baseline_iterations)) as catalog:
        return run_checks(configured_checks(cfg, offers_tools),
                          lambda sql: select_values(catalog, sql, cfg.check_timeout_s), run.run_id,
                          list(iterations), cfg.baseline_iterations, _missing(run))
