"""`agentr1 audit --run-id R [--checks FILE]`: every health check of the run's recorded `audit:`
section (with FILE's checks and thresholds layered over it) over its tables, every iteration,
read-only (a running run is audited as it stands). Exit 0 when none fails, 1 when one alerts or
cannot run (a missing or damaged table: said in one line per check), 2 on a usage error (no such
run, a bad FILE: flows/cli.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import yaml

from agent_core.audit import audit_iterations
from agent_core.config import AuditConfig, PipelineConfig
from agent_core.envs.registry import env_offers_tools
from agent_core.safe_yaml import load_yaml
from agent_core.validation import build_config
from flows.configs_lookup import recorded_config


def audit_command(data_root: str, run_id: str, checks_file: str | None = None) -> int:
    run, config = recorded_config(data_root, run_id)
    if checks_file is not None:
        config = config.model_copy(update={"audit": with_checks_from(config, Path(checks_file))})
    iterations = run.iterations()
    if not iterations:
        print(f"agentr1: run {run_id} has no iteration yet: nothing to audit")
        return 0
    rows = audit_iterations(run, config.audit, iterations,
                            env_offers_tools(config.rollout.env, config.rollout.env_kwargs))
    failing = [r for r in rows if r.failing]
    for row in failing:
        print(row.line())
    counts = Counter(r.status for r in rows)
    checks = len({r.check_name for r in rows})
    summary = ", ".join(f"{counts[s]} {s}" for s in ("ok", "alert", "error", "no_data") if counts[s])
    print(f"agentr1: audit of run {run_id}: {checks} checks x {len(iterations)} iterations: {summary}"
          + (f"; failing: {', '.join(sorted({r.check_name for r in failing}))}" if failing else ""))
    return 1 if failing else 0


def with_checks_from(config: PipelineConfig, path: Path) -> AuditConfig:
    """The run's audit section with FILE's layered over it: its `checks` added to the recorded ones,
    its `thresholds` replacing theirs check by check, any other key replacing the recorded value.
    FILE holds an audit section's keys (optionally under `audit:`), checked like a run's config."""
    if not path.is_file():
        raise FileNotFoundError(f"--checks {path}: no such file")
    try:
        data = load_yaml(path.read_text(), f"--checks {path}")
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"--checks {path}: not YAML ({' '.join(str(error).split())})") from None
    if isinstance(data, dict) and set(data) == {"audit"}:
        data = data["audit"]
    if not isinstance(data, dict):
        raise ValueError(f"--checks {path}: expected the keys of an audit section (checks:, thresholds:), "
                         f"got a {type(data).__name__}")
    audit = config.audit.model_dump(exclude_unset=False)
    merged = {**audit, **data, "checks": [*audit["checks"], *(data.get("checks") or [])],
              "thresholds": {**audit["thresholds"], **(data.get("thresholds") or {})}}
    return build_config({**config.model_dump(), "audit": merged}, source=str(path)).audit
