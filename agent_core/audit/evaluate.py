"""Judging checks: each check's (iteration, value) rows against its bounds and the run's baseline.

Pure: the SQL runs through a `select` function given by the caller (agent_core/audit/runner.py
passes the read-only run catalog's), so the rules are tested without a table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import pyarrow as pa

from agent_core.audit.checks import Check

FAILING = ("alert", "error")  # statuses that fail `agentr1 audit` and count as an alert in the loop


@dataclass(frozen=True)
class HealthRow:
    """One row of the `health` table (schemas/health.py)."""

    run_id: str
    iteration: int
    check_name: str
    source: str
    status: str  # ok | alert | no_data | error
    value: float | None
    baseline: float | None
    ratio: float | None
    rule: str
    detail: str | None

    def row(self) -> dict:
        return asdict(self)

    @property
    def failing(self) -> bool:
        return self.status in FAILING

    def line(self) -> str:
        """One line for people: `iteration 3 tool_calls_per_episode: alert: value 0.0 ...`."""
        shown = "-" if self.value is None else f"{self.value:.4g}"
        base = "" if self.baseline is None else f", baseline {self.baseline:.4g}"
        why = f": {self.detail}" if self.detail else ""
        return f"iteration {self.iteration} {self.check_name}: {self.status} (value {shown}{base}; {self.rule}){why}"


def values_by_iteration(table: pa.Table) -> dict[int, float]:
    """(iteration, value) rows as a dict; a repeated iteration keeps its first row, a null value is left out."""
    values: dict[int, float] = {}
    for iteration, value in zip(table.column("iteration").to_pylist(), table.column("value").to_pylist()):
        if iteration is not None and value is not None and int(iteration) not in values:
            values[int(iteration)] = float(value)
    return values


def baseline_of(values: dict[int, float], baseline_iterations: int) -> float | None:
    points = [v for k, v in values.items() if k < baseline_iterations and math.isfinite(v)]
    return sum(points) / len(points) if points else None


def broken_bounds(check: Check, value: float, baseline: float | None, ratio: float | None) -> list[str]:
    """What `value` breaks, in words (empty: healthy). A non-finite value always alerts."""
    if not math.isfinite(value):
        return [f"the value is {value}"]
    broken = []
    if check.max is not None and value > check.max:
        broken.append(f"{value:.4g} > max {check.max:g}")
    if check.min is not None and value < check.min:
        broken.append(f"{value:.4g} < min {check.min:g}")
    if ratio is not None and check.max_ratio is not None and ratio > check.max_ratio:
        broken.append(f"{ratio:.3g}x the baseline {baseline:.4g} > max_ratio {check.max_ratio:g}")
    if ratio is not None and check.min_ratio is not None and ratio < check.min_ratio:
        broken.append(f"{ratio:.3g}x the baseline {baseline:.4g} < min_ratio {check.min_ratio:g}")
    return broken


def judge(check: Check, values: dict[int, float], run_id: str, iteration: int, baseline_iterations: int) -> HealthRow:
    """The row of `check` at `iteration`: ok, alert or no_data (no value for the iteration)."""
    def row(status: str, value=None, baseline=None, ratio=None, detail=None) -> HealthRow:
        return HealthRow(run_id, iteration, check.name, check.source, status, value, baseline, ratio, check.rule(), detail)

    if iteration not in values:
        return row("no_data", detail=f"the check's SELECT returned no value for iteration {iteration}")
    value = values[iteration]
    baseline = baseline_of(values, baseline_iterations) if iteration >= baseline_iterations else None
    ratio = value / baseline if baseline not in (None, 0.0) and math.isfinite(value) else None
    broken = broken_bounds(check, value, baseline, ratio)
    return row("alert" if broken else "ok", value, baseline, ratio, "; ".join(broken) or None)


def run_checks(checks: Sequence[Check], select: Callable[[str], pa.Table], run_id: str, iterations: Sequence[int],
               baseline_iterations: int, missing: Callable[[Check, int], str | None] = lambda check, k: None,
               ) -> list[HealthRow]:
    """Every check at every iteration of `iterations`: one SELECT per check (all iterations at once).
    A check whose SELECT fails (ValueError: QueryError is one) is `error` with the message; one
    whose tables are missing at an iteration (`missing` says which) is `error` there."""
    rows = []
    for check in checks:
        try:
            values, failure = values_by_iteration(select(check.sql)), None
        except ValueError as error:
            values, failure = {}, " ".join(str(error).split())
        for k in iterations:
            gone = missing(check, k)
            if failure is not None or gone is not None:
                rows.append(HealthRow(run_id, k, check.name, check.source, "error", None, None, None, check.rule(),
                                      f"the check could not run: {gone or failure}"))
            else:
                rows.append(judge(check, values, run_id, k, baseline_iterations))
    return rows
