"""A run's status for `agentr1 runs`: running, finished, failed or killed, with its progress.

The training flow records how it ended in `runs/<id>/status.json` (finished, or failed with the
error); a live writer holds the run's lock. A run that is not locked and recorded no end was
stopped from outside (SIGKILL, a lost machine) and reads as killed. Iterations count the
iterations whose tracking stage committed (the last stage of an iteration).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import yaml

from agent_core.io.atomic import write_text_atomic
from agent_core.io.layout import RunLayout
from agent_core.io.locks import lock_is_held
from agent_core.io.summaries import eval_scores

END_STATUSES = ("finished", "failed")


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    status: str  # running | finished | failed | killed
    iterations_done: int
    iterations_planned: int | None  # None: the run recorded no config
    last_dev_em: float  # nan: no dev evaluation yet
    algorithm: str
    detail: str | None  # the error of a failed run


def record_run_end(run: RunLayout, status: str, detail: str | None = None) -> None:
    """Record how the run's training process ended (status: one of END_STATUSES)."""
    if status not in END_STATUSES:
        raise ValueError(f"unknown run end status {status!r}; valid: {', '.join(END_STATUSES)}")
    write_text_atomic(run.status_path, json.dumps({"status": status, "detail": detail}) + "\n")


def _recorded(run: RunLayout) -> tuple[str | None, str | None]:
    if not run.status_path.is_file():
        return None, None
    data = json.loads(run.status_path.read_text())
    return data.get("status"), data.get("detail")


def run_status(run: RunLayout) -> RunStatus:
    config = yaml.safe_load(run.config_path.read_text()) if run.config_path.is_file() else None
    done = [k for k in run.iterations() if run.manifest_path("log_iteration", k).is_file()]
    dev = [eval_scores(run.dev_eval_uri(k))[0] for k in done]
    dev = [em for em in dev if not math.isnan(em)]
    recorded, detail = _recorded(run)
    status = "running" if lock_is_held(run.lock_path) else (recorded or "killed")
    return RunStatus(
        run_id=run.run_id, status=status, iterations_done=len(done),
        iterations_planned=None if config is None else int(config.get("iterations", 0)),
        last_dev_em=dev[-1] if dev else math.nan,
        algorithm=str(((config or {}).get("algorithm") or {}).get("estimator", "?")),
        detail=detail if status == "failed" else None,
    )
