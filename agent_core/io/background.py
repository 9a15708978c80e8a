"""Writes that finish on a background thread while the pipeline goes on (runtime.background_save).

After an iteration's training, the optimizer state and the train stage's manifest are written off the critical
path: `submit` queues such jobs on one non-daemon writer thread and returns at once. Jobs run in submission
order, each only if every earlier one succeeded; `wait()` returns when the queue is empty and raises the first
failure, and every reader of what the jobs write calls it first. The manifest is still written last. A job
writes under the disk budget of the code that queued it (io/disk_budget.py: the run's margin).
Design notes: docs/architecture.md §11 (agent_core/io/background.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from agent_core.io import disk_budget

log = logging.getLogger(__name__)

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_pending: list[tuple[str, Future]] = []
_failures: list[tuple[str, BaseException]] = []  # jobs that raised, until `wait` reports them


class BackgroundWriteError(RuntimeError):
    """A background write failed; the message names the job, the cause is chained."""


class _EarlierFailure(RuntimeError):
    """Raised in place of a job that was not run because a job before it had failed."""


def submit(label: str, job: Callable[[], object]) -> None:
    """Run `job` on the writer thread after every job submitted before it, unless one of them failed.
    `label` names it in errors and in `pending()` (e.g. "iteration 3: optimizer state")."""
    budget = disk_budget.current()  # a context variable: the writer thread does not inherit the run's

    def run() -> None:
        with _lock:
            earlier = bool(_failures)
        if earlier:
            raise _EarlierFailure(f"{label}: not run, a background write before it failed")
        try:
            with disk_budget.using(budget):
                job()
        except BaseException as error:
            with _lock:
                _failures.append((label, error))
            raise

    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentr1-writer")
        _pending.append((label, _executor.submit(run)))


def wait() -> None:
    """Block until every submitted job has finished; raise BackgroundWriteError for the first that
    failed (those after it were not run). The failure is reported once: the queue is clean after."""
    while True:
        with _lock:
            if not _pending:
                break
            label, future = _pending.pop(0)
        try:
            future.result()
        except BaseException:  # recorded in _failures (or an _EarlierFailure); reported below
            pass
    with _lock:
        failures, _failures[:] = list(_failures), []
    if failures:
        label, error = failures[0]
        raise BackgroundWriteError(f"background write failed: {label}: {type(error).__name__}: {error}") from error


def wait_quietly() -> None:
    """`wait`, logging a failure instead of raising it: for paths that are already handling an error."""
    try:
        wait()
    except BackgroundWriteError as error:
        log.error("%s", error)


def close() -> None:
    """`wait_quietly`, then stop the writer thread (a run's resources end with the run,
    agent_core/run_resources.py); a later `submit` starts a new one."""
    global _executor
    wait_quietly()
    with _lock:
        executor, _executor = _executor, None
    if executor is not None:
        executor.shutdown(wait=True)


def running() -> bool:
    """Whether a writer thread exists (for tests of what a run leaves behind)."""
    with _lock:
        return _executor is not None


def pending() -> list[str]:
    """Labels of the jobs not finished yet (for logs and tests)."""
    with _lock:
        return [label for label, future in _pending if not future.done()]
