"""Waiting for and killing a child's process group, shared by the python sandbox and agent programs."""

from __future__ import annotations

import os
import select
import signal
import time


def wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait for `pid` to exit, True if it did within timeout_s. It is not reaped: while it is a
    zombie its pid, which is also its process-group id, cannot be reused, so killpg is safe."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # kernel < 5.3: poll instead
        deadline = time.monotonic() + timeout_s
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True
    try:
        return bool(select.select([pidfd], [], [], timeout_s)[0])
    finally:
        os.close(pidfd)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
