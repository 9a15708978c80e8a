"""`agentr1 audit --run-id R`: every health check of the run's recorded `audit:` section over its
tables, every iteration, read-only (a running run is audited as it stands). Exit 0 when none fails,
1 when one alerts or cannot run (a missing or damaged table: said in one line per check), 2 on a
usage error (no such run: flows/cli.py)."""

from __future__ import annotations

from collections import Counter

from agent_core.audit import audit_iterations
from flows.configs_lookup import recorded_config


def audit_command(data_root: str, run_id: str) -> int:
    run, config = recorded_config(data_root, run_id)
    iterations = run.iterations()
    if not iterations:
        print(f"agentr1: run {run_id} has no iteration yet: nothing to audit")
        return 0
    rows = audit_iterations(run, config.audit, iterations)
    failing = [r for r in rows if r.failing]
    for row in failing:
        print(row.line())
    counts = Counter(r.status for r in rows)
    checks = len({r.check_name for r in rows})
    summary = ", ".join(f"{counts[s]} {s}" for s in ("ok", "alert", "error", "no_data") if counts[s])
    print(f"agentr1: audit of run {run_id}: {checks} checks x {len(iterations)} iterations: {summary}"
          + (f"; failing: {', '.join(sorted({r.check_name for r in failing}))}" if failing else ""))
    return 1 if failing else 0
