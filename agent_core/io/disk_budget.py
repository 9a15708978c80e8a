"""The disk budget: a checkpoint, optimizer state or table is written only where the filesystem holds it
plus a margin, so a filling disk stops the run in one line before anything is half written; and the
test of whether an error, however wrapped, is a full disk. The margin (checkpoints.disk_margin_mb)
rides a context variable the run sets (`margin_for_run`, opened by agent_core/run_resources.py), so
the write functions keep their signatures; outside a run the config's default holds.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent_core.config.checkpoints import CheckpointsConfig

if TYPE_CHECKING:  # torch is not imported here: write_table's callers (`agentr1 query`) do without it
    import torch

MIB = 1 << 20
DEFAULT_MARGIN_BYTES = CheckpointsConfig().disk_margin_mb * MIB
# What a checkpoint holds besides its tensors: config, generation config, tokenizer files (SmolLM2's
# are ~3.5 MB, a Llama 3 tokenizer ~9 MB) and safetensors headers.
CHECKPOINT_SLACK_BYTES = 16 * MIB
OPTIMIZER_SLACK_BYTES = 1 * MIB  # torch.save's pickle of the param groups and step counts
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# A full disk some libraries report only in words: SQLite's SQLITE_FULL (MLflow's and Prefect's stores,
# wrapped by SQLAlchemy and MLflow), safetensors' Rust I/O error (StorageFull, "No space left on device").
_FULL_WORDS = ("database or disk is full", "No space left on device", "StorageFull")


@dataclass(frozen=True)
class Budget:
    """The free space a write must leave (bytes) and the run it writes for (None: outside a run)."""

    margin_bytes: int
    run_id: str | None = None


_BUDGET: ContextVar[Budget] = ContextVar("agentr1_disk_budget", default=Budget(DEFAULT_MARGIN_BYTES))


class DiskBudgetError(OSError):
    """A write refused before it started: too little free space for it and the margin. An OSError with
    errno ENOSPC, so whatever handles a full disk handles this too; its text is one line."""

    def __init__(self, message: str, path: str | os.PathLike):
        super().__init__(errno.ENOSPC, message, os.fspath(path))
        self.message = message

    def __str__(self) -> str:
        return self.message


@contextmanager
def margin_for_run(margin_bytes: int, run_id: str | None = None) -> Iterator[Budget]:
    """Inside the block (this thread, and what it starts with a copy of its context or hands the budget
    to, as io/background.py does) every checked write must leave `margin_bytes` free."""
    if margin_bytes < 0:
        raise ValueError(f"disk margin must be >= 0 bytes, got {margin_bytes}")
    token = _BUDGET.set(Budget(int(margin_bytes), run_id))
    try:
        yield _BUDGET.get()
    finally:
        _BUDGET.reset(token)


def current() -> Budget:
    """The budget in force here: the run's, or the default outside a run."""
    return _BUDGET.get()


@contextmanager
def using(budget: Budget) -> Iterator[None]:
    """Apply a budget captured elsewhere (`current()` in the thread that queued the work)."""
    token = _BUDGET.set(budget)
    try:
        yield
    finally:
        _BUDGET.reset(token)


# ---- estimates: cheap, from what is in memory, before a byte is written ------------------------------


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors' elements (numel x element size), each tensor once; other values (an
    optimizer's step counts as numbers) are left out."""
    seen, total = set(), 0
    for tensor in tensors:
        if hasattr(tensor, "element_size") and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def module_bytes(module: torch.nn.Module) -> int:
    """A module's parameters and buffers as a checkpoint writes them, plus CHECKPOINT_SLACK_BYTES."""
    return tensor_bytes([*module.parameters(), *module.buffers()]) + CHECKPOINT_SLACK_BYTES


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """An optimizer's state tensors (Adam: two moments per parameter), plus OPTIMIZER_SLACK_BYTES."""
    return tensor_bytes(t for state in optimizer.state.values() for t in state.values()) + OPTIMIZER_SLACK_BYTES


# ---- the check ---------------------------------------------------------------------------------------


def ensure_room(target: str | os.PathLike, needed_bytes: int, what: str) -> None:
    """Raise DiskBudgetError unless the filesystem `target` will live on has `needed_bytes` plus the
    margin free. `what` names the write in the message ("checkpoint", "steps table"); an
    `iteration=<k>` folder in the path names the iteration too."""
    budget = current()
    free = shutil.disk_usage(_existing_ancestor(Path(target))).free
    if needed_bytes + budget.margin_bytes <= free:
        return
    raise DiskBudgetError(_message(Path(target), needed_bytes, free, what, budget), target)


def _existing_ancestor(path: Path) -> Path:
    """The nearest folder of `path` that exists (a run's iteration folder may not yet): its filesystem."""
    path = path.absolute()
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor)


def _message(target: Path, needed: int, free: int, what: str, budget: Budget) -> str:
    iteration = next((part.split("=", 1)[1] for part in reversed(target.parts) if part.startswith("iteration=")), None)
    named = f"iteration {iteration}'s {what}" if iteration is not None else what
    how = (f"free space with `agentr1 prune --run-id {budget.run_id}` or lower checkpoints.keep_last, "
           if budget.run_id else "free space on that disk, ")
    return (f"not enough disk for {named} at {target}: needs {_mib(needed)} (+{_mib(budget.margin_bytes)} margin), "
            f"{_mib(free)} free; {how}or set checkpoints.disk_margin_mb")


def _mib(count: int) -> str:
    if 0 < count < MIB // 10:  # a table of a few rows: 13 KiB, not 0.0 MiB
        return f"{-(-count // 1024)} KiB"
    mib = count / MIB
    return f"{mib:.0f} MiB" if mib >= 10 or mib == 0 else f"{mib:.1f} MiB"


# ---- is this error a full disk? ----------------------------------------------------------------------


def disk_full_cause(error: BaseException) -> BaseException | None:
    """The full-disk error in `error`'s chain (itself, its causes and contexts: a background write's or
    MLflow's wrapper, a failure to record the failure): the first one, i.e. the deepest OSError with
    ENOSPC or EDQUOT (DiskBudgetError included) that names a file, else the deepest such OSError, else
    the deepest error that says so only in words (SQLite's "database or disk is full"); None if none."""
    chain, seen = [], set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        chain.insert(0, link)  # deepest first
        link = link.__cause__ or link.__context__
    full = [e for e in chain if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS]
    return (next((e for e in full if e.filename), None) or next(iter(full), None)
            or next((e for e in chain if any(words in str(e) for words in _FULL_WORDS)), None))


def named_disk_full(error: BaseException, path: str | os.PathLike) -> OSError | None:
    """For a write of `path` that failed: an OSError(ENOSPC) naming `path` when `error` is a full disk
    that names no file (a library's wrapper, a bare write()), to raise in its place; else None."""
    cause = disk_full_cause(error)
    if cause is None or (isinstance(cause, OSError) and cause.filename):
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))


def disk_full_summary(error: BaseException, where: str | os.PathLike | None = None) -> str:
    """One line for a full-disk error (`disk_full_cause`'s): the budget's own message, else the kernel's
    words and the file, or `where` (e.g. the data root) when the error names none."""
    if isinstance(error, DiskBudgetError):
        return error.message
    place = f" under {os.fspath(where)}" if where is not None else ""
    if isinstance(error, OSError):
        return f"{os.strerror(error.errno).lower()}" + (f" writing {error.filename}" if error.filename else place)
    return f"no space left on device{place} ({' '.join(str(error).split())[:200]})"


class _DiskFullWithoutTraceback(logging.Filter):
    """Keeps a record's line but drops the traceback of a full-disk exception it carries."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and disk_full_cause(record.exc_info[1]) is not None:
            record.exc_info, record.exc_text = None, None
        return True


@contextmanager
def disk_full_tracebacks_dropped(logger: logging.Logger | None = None) -> Iterator[None]:
    """Inside the block the handlers of `logger` (default: the root's, where an orchestrator's task
    failure lines end up) print a full-disk error's log lines without their traceback: the command
    says what happened and what to do in one line of its own."""
    quiet, handlers = _DiskFullWithoutTraceback(), list((logger or logging.getLogger()).handlers)
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
