"""A run's status for `agentr1 runs`: running, finished, failed or killed, with its progress.

The training flow records how it ended in `runs/<id>/status.json` (finished, or failed with the
error); a live writer holds the run's lock. A run that is not locked and recorded no end was
stopped from outside (SIGKILL, a lost machine) and reads as killed. Iterations count the
iterations whose tracking stage committed (the last stage of an iteration).

A finished run stays finished when a later command on it (a resume) fails without committing any
stage (`record_run_failure`): it changed none of the run's outputs, so the run is what it was. Such
a command may have failed on a file damaged since the run finished, on a bad override or on a
machine that went away; none of that is the run's failure. A resume that did commit a stage (it
redid damaged outputs, or went on with more iterations) and then failed leaves the run part old,
part new: that one is recorded failed, and the next resume finishes the work.
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

END_STATUSES = ("finished", "failed", "stopped")  # stopped: by the audit (audit.on_alert: stop), resumable


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    status: str  # running | finished | failed | stopped | killed
    iterations_done: int
    iterations_planned: int | None  # None: the run recorded no config
    last_dev_em: float  # nan: no dev evaluation yet
    algorithm: str
    detail: str | None  # the error of a failed run, the audit's reason of a stopped one


def record_run_end(run: RunLayout, status: str, detail: str | None = None) -> None:
    """Record how the run's training process ended (status: one of END_STATUSES)."""
    if status not in END_STATUSES:
        raise ValueError(f"unknown run end status {status!r}; valid: {', '.join(END_STATUSES)}")
    write_text_atomic(run.status_path, json.dumps({"status": status, "detail": detail}) + "\n")


def record_run_failure(run: RunLayout, detail: str, stages_committed: int) -> str:
    """Record that a training process on the run failed with `detail`, unless the run was recorded
    finished and the process committed no stage (module docstring); the status now recorded."""
    recorded, _ = _recorded(run)
    if recorded == "finished" and stages_committed == 0:
        return "finished"
    record_run_end(run, "failed", detail)
    return "failed"


def _recorded(run: RunLayout) -> tuple[str | None, str | None]:
    """The recorded end; (None, None) when none is, or the record is damaged (then it reads as killed)."""
    if not run.status_path.is_file():
        return None, None
    try:
        data = json.loads(run.status_path.read_text())
        return data.get("status"), data.get("detail")
    except (ValueError, AttributeError):  # not JSON, not UTF-8, not an object
        return None, None


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
        detail=detail if status in ("failed", "stopped") else None,
    )
