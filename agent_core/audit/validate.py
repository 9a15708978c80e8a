"""The `audit:` section checked before a run starts (agent_core.validation.check_names): threshold
overrides name built-in checks, user checks do not reuse their names, and each user SQL is one
SELECT over the run's views returning `iteration` and `value` (bound against empty views, so
DuckDB's own error is told, on one line, before anything runs)."""

from __future__ import annotations

from agent_core.audit.checks import BUILTIN_NAMES
from agent_core.config.audit import AuditConfig
from agent_core.config_errors import Problem
from agent_core.io.run_catalog import QueryError, check_run_sql


def audit_problems(cfg: AuditConfig) -> list[Problem]:
    problems = [Problem(f"audit.thresholds.{name}", f"no built-in check is named {name!r}; built-in checks: "
                        f"{', '.join(BUILTIN_NAMES)} (a check of your own goes under audit.checks)")
                for name in cfg.thresholds if name not in BUILTIN_NAMES]
    for i, check in enumerate(cfg.checks):
        if check.name in BUILTIN_NAMES:
            problems.append(Problem(f"audit.checks.{i}.name", f"{check.name!r} is a built-in check's name; "
                                    f"change its bounds under audit.thresholds.{check.name}, or pick another name"))
        try:
            check_run_sql(check.sql)
        except QueryError as error:
            problems.append(Problem(f"audit.checks.{i}.sql", f"check {check.name!r}: {error}"))
    return problems
