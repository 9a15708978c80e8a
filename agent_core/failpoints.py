"""Failpoints: named places where a crash is most telling, for testing that a run survives one.

Each durable write and each long-running stage passes through `failpoint("<name>")`, which normally only
reads one environment variable. With `AGENTR1_FAILPOINT=<name>[@<n>][=hang|=enospc]` the process kills itself
with SIGKILL the n-th time (default: the first) it reaches `<name>`; with `=hang` that thread blocks forever;
with `=enospc` the call raises `OSError(ENOSPC)`, as a write there would on a full disk.
`AGENTR1_FAILPOINT_TRACE=<file>` appends every failpoint reached to the file, one name per line.
Design notes: docs/architecture.md §11 (agent_core/failpoints.py).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

FAILPOINT_ENV = "AGENTR1_FAILPOINT"
TRACE_ENV = "AGENTR1_FAILPOINT_TRACE"

_counts: dict[str, int] = {}
_lock = threading.Lock()


ACTIONS = ("kill", "hang", "enospc")


def failpoint(name: str, path: str | os.PathLike | None = None) -> None:
    """Crash here (SIGKILL to this process) if AGENTR1_FAILPOINT selects this visit of `name`; or hang,
    or raise OSError(ENOSPC) naming `path` (the file being written, if the caller knows it)."""
    spec, trace = os.environ.get(FAILPOINT_ENV), os.environ.get(TRACE_ENV)
    if not spec and not trace:
        return
    with _lock:
        _counts[name] = count = _counts.get(name, 0) + 1
        if trace:  # a test's append-only trace (AGENTR1_FAILPOINT_TRACE), not an output: written in place
            with open(trace, "a") as sink:
                sink.write(name + "\n")
    if spec and _selects(spec, name, count):
        action = _action(spec)
        if action == "hang":
            threading.Event().wait()  # never set: this thread stops answering
        if action == "enospc":  # what the kernel answers a write on a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None if path is None else os.fspath(path))
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def failpoint_environment() -> dict[str, str]:
    """This process's failpoint settings, for a process started elsewhere (a Ray actor does not
    inherit the driver's environment) so the tests can crash its own code paths too."""
    return {key: os.environ[key] for key in (FAILPOINT_ENV, TRACE_ENV) if key in os.environ}


def _action(spec: str) -> str:
    """kill (no `=` suffix), hang or enospc; an unknown action is an error, not a silent kill."""
    _, equals, action = spec.partition("=")
    if not equals:
        return "kill"
    if action not in ACTIONS:
        raise ValueError(f"${FAILPOINT_ENV}={spec!r}: unknown action {action!r}; valid: {', '.join(ACTIONS)}")
    return action


def _selects(spec: str, name: str, count: int) -> bool:
    target, _, nth = spec.partition("=")[0].partition("@")
    return target == name and count == (int(nth) if nth else 1)
