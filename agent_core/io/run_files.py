"""Whether a run's files can be written, checked before a command starts anything (issue 39, item 10).

A resume, a rerun or a train of an existing run id replaces the run's files atomically (a temporary,
then a rename over the old one: agent_core/io/atomic.py). That fails late, after the Prefect server
started and stages ran, when a file the run writes is a directory (`status.json` made a folder), or
when a file or folder is immutable or append-only (`chattr +i`/`+a`: even root cannot replace it),
or a folder is not writable. `check_run_writable` names the first such path in one line first.
Conservative by design: a file of the run that this command would not have rewritten is named too
(a writer owns its whole run folder).
"""

from __future__ import annotations

import array
import fcntl
import os
from pathlib import Path

_FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h: the inode flags chattr sets
_IMMUTABLE, _APPEND_ONLY = 0x10, 0x20
# Files a writer replaces by name: a folder there stops it.
_FILES = ("status.json", "config.yaml")
_FILE_SUFFIXES = (".parquet", ".json", ".yaml", ".pt", ".safetensors")


class RunNotWritableError(ValueError):
    """A file or folder of the run that the command would have to replace cannot be replaced."""


def check_run_writable(run_dir: str | os.PathLike, run_id: str) -> None:
    """RunNotWritableError naming the first path under `run_dir` that a writer could not replace;
    nothing when the run folder does not exist yet (it is made then) or every path is fine."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    for name in _FILES:
        _check_is_file(run_dir / name, run_id)
    for root, dirs, files in os.walk(run_dir):
        folder = Path(root)
        _check_path(folder, run_id, is_dir=True)
        for name in files:
            _check_path(folder / name, run_id, is_dir=False)
        for name in dirs:
            if name.endswith(_FILE_SUFFIXES) and not name.endswith(".tmp"):
                _check_is_file(folder / name, run_id)


def _check_is_file(path: Path, run_id: str) -> None:
    if path.is_symlink() or not path.exists() or path.is_file():
        return
    what = "a folder" if path.is_dir() else "not a regular file"
    raise RunNotWritableError(f"run {run_id!r} cannot be written: {path} is {what} where the run keeps a file; "
                              "move it aside (the run rewrites it)")


def _check_path(path: Path, run_id: str, is_dir: bool) -> None:
    if path.is_symlink():
        return
    flags = _inode_flags(path)
    if flags & (_IMMUTABLE | _APPEND_ONLY):
        kind = "immutable" if flags & _IMMUTABLE else "append-only"
        raise RunNotWritableError(f"run {run_id!r} cannot be written: {path} is {kind} (chattr "
                                  f"{'+i' if flags & _IMMUTABLE else '+a'}), so the run cannot replace it; "
                                  f"clear it with `chattr -{'i' if flags & _IMMUTABLE else 'a'} {path}`")
    if is_dir and not os.access(path, os.W_OK | os.X_OK):
        raise RunNotWritableError(f"run {run_id!r} cannot be written: permission denied on the folder {path} "
                                  "(this user cannot create files in it); fix its permissions or owner")


def _inode_flags(path: Path) -> int:
    """The inode's chattr flags; 0 where the file system keeps none (tmpfs, overlay without them)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return 0  # unreadable: the run's own write says what is wrong
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        return flags[0]
    except OSError:  # ENOTTY, EOPNOTSUPP: no such flags here
        return 0
    finally:
        os.close(fd)
