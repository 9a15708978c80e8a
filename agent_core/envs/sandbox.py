"""Run model-written Python in a separate, locked-down interpreter: `run_python` and the `python` tool.

Each call starts a fresh `python -I -S` child (stdlib only, never a fork of the caller) in a new session, in a
private temporary working directory, with only HOME, TMPDIR, PATH and LANG; `sandbox_child.py` bootstraps it.
Independent layers (rlimits, netns, tmpfs, no_capabilities, landlock_*, seccomp, audit_hook) apply where the
kernel gives them (`SandboxResult.layers`, `sandbox_layers()`); the program cannot forge the caller's report.
Design notes: docs/architecture.md §11 (agent_core/envs/sandbox.py).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from typing import Collection, Literal

from agent_core.envs.processes import kill_group, signal_name, wait_unreaped
from agent_core.envs.tools import TOOLS, Tool, ToolResources, ToolResult

_CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")

SANDBOX_LAYERS = (
    "rlimits", "netns", "tmpfs", "no_capabilities", "landlock_fs", "landlock_net", "landlock_scope", "seccomp",
    "audit_hook",
)
KilledBy = Literal["timeout", "memory", "signal"]
DiskFull = Literal["size", "files"]
MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_OPEN_FILES = 64
MAX_TASKS_IN_NAMESPACE = 32
MAX_FILES = 4096  # the scratch tmpfs's inodes
DEFAULT_DISK_MB = 64
MEMORY_EXIT_CODE = 121  # the child's exit status after an uncaught MemoryError
MIN_MEMORY_MB = 64  # headroom for the interpreter, the bootstrap and a traceback
TRUNCATION_MARKER = "\n[truncated]"
_DRAIN_GRACE_S = 3.0  # how long to wait for the pipes to close once the child is dead


@dataclass(frozen=True)
class SandboxResult:
    """One run. exit_code: the process's exit status, negative for "killed by that signal" (as
    subprocess reports it). timed_out: the wall-clock or CPU limit stopped it. truncated: stdout
    or stderr was cut at max_output_chars. layers: the isolation layers this run actually had.
    disk_full: its scratch tmpfs ended full ("size": disk_mb, "files": MAX_FILES), None if not or
    if it had no tmpfs."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    killed_by: KilledBy | None
    seconds: float
    truncated: bool
    layers: tuple[str, ...]
    timeout_s: float
    memory_mb: int
    disk_full: DiskFull | None = None
    disk_mb: int = DEFAULT_DISK_MB

    def tool_text(self) -> str:
        """What the model sees: stdout, then stderr, then why it stopped if not cleanly."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("stderr:\n" + self.stderr.rstrip("\n"))
        if self.disk_full == "size":
            parts.append(f"disk full: tried to write more than {self.disk_mb} MB in total (the limit for one call)")
        elif self.disk_full == "files":
            parts.append(f"disk full: tried to create more than {MAX_FILES} files (the limit for one call)")
        if self.killed_by == "timeout":
            parts.append(f"timed out after {self.timeout_s:g}s")
        elif self.killed_by == "memory":
            parts.append(f"killed: memory limit ({self.memory_mb} MB)")
        elif self.killed_by == "signal":
            parts.append(f"killed by signal {signal_name(-self.exit_code)}")
        elif self.exit_code != 0:
            parts.append(f"exit code {self.exit_code}")
        return "\n".join(parts) if parts else "(no output)"


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
               disk_mb: int = DEFAULT_DISK_MB, layers: Collection[str] | None = None) -> SandboxResult:
    """Run `code` as a program in the sandbox (see the module docstring); never raises for what
    the code does. disk_mb: the most its files may hold in total (the tmpfs layer). layers: None for
    every layer this machine has, or a subset of SANDBOX_LAYERS."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    check_limits(timeout_s, memory_mb, max_output_chars, disk_mb)
    wanted = SANDBOX_LAYERS if layers is None else (layers,) if isinstance(layers, str) else tuple(layers)
    unknown = sorted(set(wanted) - set(SANDBOX_LAYERS))
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise ValueError(f"unknown sandbox layer(s) {names}; valid: {', '.join(SANDBOX_LAYERS)}")
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="agent-sandbox-"))
    try:
        # A scratch file in the run's own temporary directory, deleted below: no reader ever sees it
        # half-written, so it does not go through agent_core.io's atomic writes.
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as file:
            file.write(code)
        return _run_child(workdir, float(timeout_s), memory_mb, disk_mb, max_output_chars, wanted)
    finally:
        _remove_tree(workdir)


def check_limits(timeout_s: float, memory_mb: int, max_output_chars: int, disk_mb: int = DEFAULT_DISK_MB) -> None:
    """ValueError naming the first limit that `run_python` would refuse."""
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= MIN_MEMORY_MB):
        raise ValueError(f"memory_mb must be an int >= {MIN_MEMORY_MB}, got {memory_mb!r}")
    if not (isinstance(max_output_chars, int) and max_output_chars >= 1):
        raise ValueError(f"max_output_chars must be an int >= 1, got {max_output_chars!r}")
    if not (isinstance(disk_mb, int) and not isinstance(disk_mb, bool) and disk_mb >= 1):
        raise ValueError(f"disk_mb must be an int >= 1 (MB the program's files may hold in total), got {disk_mb!r}")


@cache
def sandbox_layers() -> tuple[str, ...]:
    """The layers this machine gives a run (probed once with an empty program)."""
    return run_python("pass").layers


def _run_child(workdir: str, timeout_s: float, memory_mb: int, disk_mb: int, max_output_chars: int,
               wanted: tuple[str, ...]) -> SandboxResult:
    status, child_end = socket.socketpair()  # the status channel: see the module docstring
    spec = {"layers": list(wanted), "timeout_s": timeout_s, "memory_mb": memory_mb, "disk_mb": disk_mb,
            "parent_pid": os.getpid(), "status_fd": child_end.fileno()}
    command = [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", _CHILD_SCRIPT, json.dumps(spec)]
    environment = {"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    started = time.monotonic()
    try:
        process = subprocess.Popen(command, cwd=workdir, env=environment, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                   pass_fds=(child_end.fileno(),))
    except BaseException:
        status.close()
        raise
    finally:
        child_end.close()
    limit_bytes = 4 * max_output_chars + 4  # UTF-8 needs at most 4 bytes per character
    readers = [_CappedReader(stream, limit_bytes) for stream in (process.stdout, process.stderr)]
    deadline = started + timeout_s
    layers, scratch = _handshake(status, process.pid, workdir, deadline)
    try:
        timed_out = not wait_unreaped(process.pid, max(0.0, deadline - time.monotonic()))
        kill_group(process.pid)  # also whatever the program left behind in its group
        returncode, cpu_s = _reap(process)
        disk_full = _disk_full(scratch) if scratch is not None else None
    finally:
        if scratch is not None:
            os.close(scratch)
    seconds = time.monotonic() - started
    for reader in readers:
        reader.join(_DRAIN_GRACE_S)
    (stdout, cut_out), (stderr, cut_err) = (reader.text(max_output_chars) for reader in readers)
    # RLIMIT_CPU's SIGXCPU (or the SIGKILL after it) counts only if the kernel says the CPU was used
    timed_out = timed_out or ("rlimits" in layers and cpu_s >= _cpu_limit_s(timeout_s) - 0.01)
    killed_by: KilledBy | None = (
        "timeout" if timed_out else "memory" if returncode == MEMORY_EXIT_CODE
        else "signal" if returncode < 0 else None
    )
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=returncode, timed_out=timed_out,
                         killed_by=killed_by, seconds=seconds, truncated=cut_out or cut_err, layers=layers,
                         timeout_s=timeout_s, memory_mb=memory_mb, disk_full=disk_full, disk_mb=disk_mb)


def _handshake(status: socket.socket, pid: int, workdir: str, deadline: float) -> tuple[tuple[str, ...], int | None]:
    """The layers from the child's status line, then "go" and the channel closed. Also, while the
    child waits, a descriptor of its tmpfs if it got one (to measure it after the run)."""
    with status:
        data = b""
        try:
            while b"\n" not in data and (remaining := deadline - time.monotonic()) > 0:
                status.settimeout(remaining)
                if not (chunk := status.recv(4096)):
                    break  # the child died before its layers were in place
                data += chunk
        except OSError:  # TimeoutError included: the run's time is up; the child gets no "go"
            return (), None
        line, newline, _ = data.partition(b"\n")
        if not (newline and line.startswith(b"layers ")):
            return (), None
        layers = tuple(name for name in line[7:].decode("ascii", "replace").split(",") if name in SANDBOX_LAYERS)
        scratch = _open_scratch(pid, workdir) if "tmpfs" in layers else None
        try:
            status.sendall(b"1")
        except OSError:
            pass  # the child is gone; waiting for it says so
        return layers, scratch


def _open_scratch(pid: int, workdir: str) -> int | None:
    """A descriptor of the child's tmpfs (seen through its mount namespace), or None."""
    try:
        fd = os.open(f"/proc/{pid}/root{workdir}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(fd).st_dev == os.stat(workdir).st_dev:  # not the tmpfs: nothing to measure
        os.close(fd)
        return None
    return fd


def _disk_full(scratch: int) -> DiskFull | None:
    usage = os.fstatvfs(scratch)
    return "size" if usage.f_bfree == 0 else "files" if usage.f_ffree == 0 else None


def _reap(process: subprocess.Popen) -> tuple[int, float]:
    """Exit status (negative: killed by that signal) and CPU seconds of all its threads, from wait4."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return process.returncode, usage.ru_utime + usage.ru_stime


def _cpu_limit_s(timeout_s: float) -> float:
    """RLIMIT_CPU's soft limit as sandbox_child._apply_rlimits sets it (the child inherits our hard one)."""
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    limit = math.ceil(timeout_s) + 1
    return limit if hard == resource.RLIM_INFINITY else min(limit, hard)


class _CappedReader(threading.Thread):
    """Drains one pipe to EOF, keeping the first `limit` bytes: the child never blocks on a full
    pipe and a flood of output never fills the caller's memory."""

    def __init__(self, stream, limit: int):
        super().__init__(daemon=True)  # a grandchild holding the pipe must not hang the caller
        self.stream, self.limit, self.kept, self.total = stream, limit, bytearray(), 0
        self.start()

    def run(self) -> None:
        with self.stream:
            while chunk := self.stream.read1(65536):
                self.total += len(chunk)
                if len(self.kept) < self.limit:
                    self.kept += chunk[: self.limit - len(self.kept)]

    def text(self, max_chars: int) -> tuple[str, bool]:
        text = bytes(self.kept).decode("utf-8", errors="replace")
        if len(text) > max_chars or self.total > len(self.kept):
            return text[:max_chars] + TRUNCATION_MARKER, True
        return text, False


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, failed_path, _exc_info):
        os.chmod(os.path.dirname(failed_path), stat.S_IRWXU)  # the program may have chmod-ed it away
        if os.path.isdir(failed_path) and not os.path.islink(failed_path):
            os.chmod(failed_path, stat.S_IRWXU)
        function(failed_path)

    shutil.rmtree(path, onerror=make_writable_and_retry)


# ---- the `python` tool -------------------------------------------------------------------------

_TOOL_GRACE_S = 5.0  # execute_call's own timeout must not fire before the sandbox reports one


class PythonTool(Tool):
    """Runs the model's program with `run_python`; the text is `SandboxResult.tool_text()`."""

    name = "python"
    description = (
        "Run a Python 3 program (standard library only) and return what it prints. Each call is a fresh "
        "process: no network, no files outside its working directory, no subprocesses, nothing kept between calls."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 1,
                                "description": "The whole program; print() what you want to see."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, *, timeout_s: float, memory_mb: int, max_output_chars: int, disk_mb: int = DEFAULT_DISK_MB):
        check_limits(timeout_s, memory_mb, max_output_chars, disk_mb)
        self.limits = {"timeout_s": timeout_s, "memory_mb": memory_mb, "max_output_chars": max_output_chars,
                       "disk_mb": disk_mb}
        super().__init__(timeout_s=timeout_s + _TOOL_GRACE_S)

    def execute(self, arguments: dict) -> ToolResult:
        result = run_python(arguments["code"], **self.limits)
        info = {"exit_code": result.exit_code, "killed_by": result.killed_by, "seconds": result.seconds,
                "truncated": result.truncated, "disk_full": result.disk_full, "sandbox_layers": list(result.layers)}
        return ToolResult(text=result.tool_text(), info=info)

@TOOLS.register("python")
def make_python_tool(resources: ToolResources, *, timeout_s: float = 5.0, memory_mb: int = 512,
                     max_output_chars: int = 4000, disk_mb: int = DEFAULT_DISK_MB) -> PythonTool:
    return PythonTool(timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars, disk_mb=disk_mb)
