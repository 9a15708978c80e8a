"""The failing checks for people: markdown for the run's report folder (`report/health.md`, logged
with the report to MLflow) and the Prefect artifact."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent_core.audit.evaluate import HealthRow
from agent_core.io.atomic import write_text_atomic
from agent_core.io.layout import RunLayout
from agent_core.io.run_catalog import health_uri
from agent_core.io.tables import TableReadError, read_table, table_exists

REPORT_FILE = "health.md"


def health_markdown(run_id: str, failing: Sequence[HealthRow]) -> str:
    """The failing checks as a markdown table (or a line saying none fails)."""
    lines = [f"# Health checks of run `{run_id}`", ""]
    if not failing:
        return "\n".join(lines + ["No check fails.", ""])
    lines += ["| iteration | check | status | value | baseline | rule | why |", "|---:|---|---|---:|---:|---|---|"]
    for r in failing:
        value = "-" if r.value is None else f"{r.value:.4g}"
        baseline = "-" if r.baseline is None else f"{r.baseline:.4g}"
        why = (r.detail or "").replace("|", "\\|")
        lines.append(f"| {r.iteration} | {r.check_name} | {r.status} | {value} | {baseline} | {r.rule} | {why} |")
    return "\n".join(lines + ["", "Checks and their bounds: docs/guides/watch-your-agent.md; "
                              "every value: `agentr1 query \"select * from health\"`.", ""])


def failing_rows(run: RunLayout) -> list[HealthRow]:
    """The failing rows of every health table the run has written (a damaged one is skipped: the
    next audit of that iteration rewrites it)."""
    rows = []
    for k in run.iterations():
        uri = health_uri(run, k)
        if not table_exists(uri):
            continue
        try:
            table = read_table("health", uri)
        except (TableReadError, ValueError):
            continue
        rows += [HealthRow(**row) for row in table.to_pylist() if row["status"] in ("alert", "error")]
    return rows


def write_health_report(run: RunLayout) -> Path:
    """`report/health.md`: the failing checks of the run so far."""
    path = run.report_dir / REPORT_FILE
    write_text_atomic(path, health_markdown(run.run_id, failing_rows(run)))
    return path


def health_section(run: RunLayout) -> str:
    """The failing checks as a section of the run's report.md ("" when none fails)."""
    failing = failing_rows(run)
    return "" if not failing else "\n" + health_markdown(run.run_id, failing).replace("# Health checks", "## Failing health checks", 1)
