"""What every stage task shares: the task decorator, a logger that works in and out of a run, and
the resume check (io/manifests.py)."""

from __future__ import annotations

import logging
from functools import partial

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

from agent_core.failpoints import failpoint
from agent_core.io.manifests import StageRecord

# Stages skip or redo work by their manifests (`completed_outputs`), not through Prefect's result
# cache: its cache keys would hash configs and paths, not what the inputs hold.
stage_task = partial(task, cache_policy=NO_CACHE, persist_result=False)


def stage_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow/task run (shown in the UI), a plain logger outside."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(f"tasks.{name}")


def completed_outputs(record: StageRecord, resume: bool, what: str) -> dict[str, str] | None:
    """The outputs of `record`'s stage if it already completed with the same inputs and settings
    (logged as skipped), else None: the stage must run. resume=False (an explicit rerun) always runs."""
    if not resume:
        return None
    done = record.completed()
    if done is None:
        failpoint(f"stage:{record.stage}:start")
    else:
        stage_logger(record.stage).info("%s: already complete with these inputs and settings, skipped (%s)",
                                        what, record.path)
    return done
