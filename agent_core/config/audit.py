"""The `audit:` section of a pipeline config: the behaviour health checks run after each
iteration's training (agent_core/audit; docs/guides/watch-your-agent.md).

Its own module of the config package (agent_core/config/pipeline.py only adds the field) so the
audit's settings read in one place. Names (a threshold for a check that does not exist) and user
SQL (one SELECT over the run's views returning `iteration` and `value`) are checked by
agent_core.validation.check_names, before any run starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

BOUND_KEYS = ("max", "min", "max_ratio", "min_ratio")


class CheckBounds(BaseModel):
    """When a check alerts: its value above `max` or below `min`, or its value divided by its
    baseline (the mean over the run's first `audit.baseline_iterations` iterations) above
    `max_ratio` or below `min_ratio`. A bound left out (null) is not checked. As an override of a
    built-in check (`audit.thresholds.<name>`), only the keys given replace the built-in's bounds."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max: float | None = Field(None, description="alert when the value is above this")
    min: float | None = Field(None, description="alert when the value is below this")
    max_ratio: float | None = Field(None, gt=0, description="alert when value / baseline is above this (growth, spikes)")
    min_ratio: float | None = Field(None, ge=0, description="alert when value / baseline is below this (collapse)")
    enabled: bool = Field(True, description="false: the check is not run")


class UserCheck(CheckBounds):
    """A check written in the config: one read-only SELECT over the run's views (steps, rewards,
    advantages, train_metrics, prompts, health) returning one row per iteration with the columns
    `iteration` and `value`, e.g. `select iteration, avg(len(response_ids)) as value from steps
    group by iteration`; it runs through the same read-only SQL function as `agentr1 query`."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,63}$", description="the check's name (health.check_name)")
    sql: str = Field(min_length=1, description="one SELECT returning columns iteration and value")
    description: str = Field("", description="what the check watches, for the report")

    @model_validator(mode="after")
    def _has_a_bound(self) -> "UserCheck":
        if all(getattr(self, key) is None for key in BOUND_KEYS):
            raise ValueError(f"audit check {self.name!r} has no bound: set at least one of {', '.join(BOUND_KEYS)}")
        return self


class AuditConfig(BaseModel):
    """The behaviour audit run after each iteration's training: built-in checks (agent_core/audit/checks.py)
    and the config's own, results in the `health` table, MLflow metrics (`health.<check>`), the run's
    report and a console line."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(True, description="run the audit after each iteration (`agentr1 audit` runs it on demand)")
    on_alert: Literal["warn", "stop"] = Field(
        "warn", description="warn: log the failing checks and go on; stop: end the run after the iteration, "
        "recorded as stopped with the reason (`agentr1 runs`); `agentr1 resume` continues it")
    baseline_iterations: int = Field(
        2, ge=1, description="the trend rules compare an iteration with the mean of iterations 0..N-1; "
        "those iterations are judged by the absolute bounds only")
    thresholds: dict[str, CheckBounds] = Field(
        default_factory=dict, description="per built-in check name: bounds replacing its defaults "
        "(only the keys given), or enabled: false")
    checks: list[UserCheck] = Field(default_factory=list, description="user-defined SQL checks")
    check_timeout_s: float = Field(
        60.0, gt=0, description="seconds one check's SQL may run before it is interrupted and recorded as "
        "status error (a check over a long run's tables takes well under a second)")

    @model_validator(mode="after")
    def _unique_names(self) -> "AuditConfig":
        names = [check.name for check in self.checks]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"audit.checks: the name {', '.join(repeated)} is used more than once")
        return self
