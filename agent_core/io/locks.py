"""One writer per run: an exclusive lock on `runs/<run_id>/.lock`, and the sweep of what a killed
writer left behind.

Two processes writing the same run would interleave two histories of the same tables, so the
second one is refused with the first one's pid. The lock is `flock` on an open file: the kernel
drops it when its holder exits, however it exits (SIGKILL, out of memory), so a crashed run never
needs a stale lock removed by hand. Different runs under one data root never share a lock (and
never share a file: each writes only under its own run directory, and shared things, datasets and
MLflow's SQLite store, are written atomically or by SQLite's own locking).

A writer killed mid-write leaves hidden temporaries (`.steps.parquet.<rand>.tmp`,
`.checkpoint.tmp-<hex>`, `.checkpoint.old-<hex>`): never visible as tables or checkpoints (readers
and globs skip dot names), but dead weight. Under the lock nobody else can be writing them, so
`sweep_temporaries` removes them.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The temporary names of tables.write_table, checkpoints.save_policy/swap_into_place, critics,
# optimizer states and manifests.
_TEMPORARY = re.compile(r"^\..+(\.tmp|\.tmp-[0-9a-f]{8}|\.old-[0-9a-f]{8})$")


class RunInUseError(RuntimeError):
    """Another live process is writing this run."""


# Locks taken by `command_holds_run` for the whole command: a `run_lock` of the same path inside it
# (the flow's) runs under that hold instead of locking against its own process.
_HELD_BY_COMMAND: set[Path] = set()


@contextmanager
def command_holds_run(lock_path: str | os.PathLike, run_id: str) -> Iterator[None]:
    """The command's hold of the run's lock, taken before it starts Prefect (two `agentr1 train
    --run-id same` at once: the second is refused in one line at once, not after both servers raced
    to migrate Prefect's database); the flow's `run_lock` inside the block runs under it."""
    key = Path(os.path.realpath(lock_path))
    with run_lock(lock_path, run_id):
        _HELD_BY_COMMAND.add(key)
        try:
            yield
        finally:
            _HELD_BY_COMMAND.discard(key)


@contextmanager
def run_lock(lock_path: str | os.PathLike, run_id: str) -> Iterator[None]:
    """Hold the run's lock for the duration of the block; RunInUseError if another process has it
    (or another block of this one, except under the command's own hold: `command_holds_run`)."""
    lock_path = Path(lock_path)
    if Path(os.path.realpath(lock_path)) in _HELD_BY_COMMAND:
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(lock_path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise _in_use(run_id, lock_path, handle.read()) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing the descriptor releases the flock


def _in_use(run_id: str, lock_path: Path, holder: str) -> RunInUseError:
    return RunInUseError(f"run {run_id!r} is being written by another process (pid {holder.strip() or 'unknown'}; "
                         f"lock {lock_path}): wait for it to end, or use another run id")


def check_run_free(lock_path: str | os.PathLike, run_id: str) -> None:
    """RunInUseError, as `run_lock` would raise it, if a live process holds the run's lock; creates
    nothing. The command calls it before it starts a Prefect server, so a second writer is told at once;
    `run_lock` still decides (the writer may start between this check and it)."""
    lock_path = Path(lock_path)
    if lock_is_held(lock_path):
        try:
            holder = lock_path.read_text()
        except OSError:
            holder = ""
        raise _in_use(run_id, lock_path, holder)


def lock_is_held(lock_path: str | os.PathLike) -> bool:
    """Whether a live process holds the lock at `lock_path` (False when there is no lock file)."""
    lock_path = Path(lock_path)
    if not lock_path.is_file():
        return False
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def sweep_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Remove the hidden temporaries of killed writers under `directory`; the paths removed.

    Call only while holding the directory's run lock: a live writer's temporary looks the same."""
    removed = []
    for root, dirs, files in os.walk(directory):
        for name in [d for d in dirs if _TEMPORARY.match(d)]:
            shutil.rmtree(Path(root) / name, ignore_errors=True)
            removed.append(Path(root) / name)
            dirs.remove(name)
        for name in files:
            if _TEMPORARY.match(name):
                (Path(root) / name).unlink(missing_ok=True)
                removed.append(Path(root) / name)
    return removed
