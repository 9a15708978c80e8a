"""What every stage task shares: the task decorator and a logger that works in and out of a run."""

from __future__ import annotations

import logging
from functools import partial

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

# Stages skip or redo work by looking at their output tables, not through Prefect's result cache:
# hashing configs and paths for cache keys buys nothing here.
stage_task = partial(task, cache_policy=NO_CACHE, persist_result=False)


def stage_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow/task run (shown in the UI), a plain logger outside."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(f"tasks.{name}")
