"""Atomic file writes: a reader sees the old file or the new one, never part of either.

The bytes go to a hidden temporary file beside the target (`.<name>.<random>.tmp`: a leading dot,
so table globs and listings skip it, and `locks.sweep_temporaries` recognises a killed writer's
leftover), are flushed and fsynced, and the file is renamed over the target with `os.replace`,
atomic on one filesystem; then the folder is fsynced so the rename itself survives a power cut. A write
that fails (a full disk included) removes its temporary, and a full disk's error names the target file.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from agent_core.failpoints import failpoint


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", failpoint_prefix: str | None = None) -> Iterator[IO]:
    """Open a temporary file to write `path`'s new content into; publish it when the block ends
    without an exception (else remove it). failpoint_prefix: `<prefix>:temp_written` is passed with
    the content complete but unpublished, `<prefix>:published` after the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, mode) as sink:
            yield sink
            sink.flush()
            os.fsync(sink.fileno())
        if failpoint_prefix:
            failpoint(f"{failpoint_prefix}:temp_written", path)
        os.replace(temp_name, path)
    except BaseException as error:
        Path(temp_name).unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno == errno.ENOSPC and not error.filename:
            # a write() or fsync() that found the disk full names no file: say which one it was
            raise OSError(errno.ENOSPC, error.strerror or os.strerror(errno.ENOSPC), str(path)) from error
        raise
    fsync_directory(path.parent)
    if failpoint_prefix:
        failpoint(f"{failpoint_prefix}:published", path)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically (`atomic_file`); return the path."""
    with atomic_file(path, "wb") as sink:
        sink.write(text.encode("utf-8"))
    return Path(path)


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable; some filesystems refuse to open a directory: skip there."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
