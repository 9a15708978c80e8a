"""Run model-written Python in a separate, locked-down interpreter: `run_python` and the `python` tool.

Each call starts a fresh `python -I -S` (isolated mode, no site-packages: the standard library
only) from `subprocess`, never a fork of the caller, in a new session. Its working directory is a
private temporary directory, also HOME and TMPDIR, removed afterwards; its environment holds only
HOME, TMPDIR, PATH and LANG (nothing of the caller's). `sandbox_child.py` is the child's bootstrap
(run as a script, stdlib only): it applies the layers below, then exec()s the code from
`main.py` in the working directory. The caller enforces the wall-clock timeout by killing the
child's process group, and caps stdout/stderr at `max_output_chars` each ("[truncated]").

Layers, each independent (`SandboxResult.layers` lists those a run got; `sandbox_layers()` those
this machine gives):

- rlimits: CPU seconds (timeout + 1, then SIGXCPU), address space = memory_mb (allocations fail
  with MemoryError), files <= 16 MB, 64 open files, no core dumps. RLIMIT_NPROC (32 tasks) only
  for a non-root caller whose child got a user namespace: it counts per user and namespace, so
  elsewhere it would count all of the user's processes, and the kernel never enforces it for uid
  0. Forks are stopped by seccomp and the audit hook instead; threads are bounded by memory_mb.
- netns: a new user + network namespace: one loopback interface, down. No IP traffic at all,
  including to the host's 127.0.0.1. Also drops every capability the caller had (root included).
- no_capabilities: capset() to an empty set (what is left after netns, or root's own).
- landlock_fs (Landlock ABI >= 1): reads only beneath the interpreter's sys.path, the system
  library dirs (/lib, /lib64, /usr/lib, /usr/lib64, /usr/local/lib), /usr/share/zoneinfo,
  /etc/ld.so.cache and /dev/{null,zero,random,urandom}; writes only beneath the working
  directory and /dev/null; no directory listing of `/`, /etc, /home, /tmp, ... .
- landlock_net (ABI >= 4): TCP bind and connect denied on every port.
- landlock_scope (ABI >= 6): no signals to processes outside the sandbox, no connecting to
  abstract UNIX sockets outside it.
- seccomp (x86_64 only): fork, vfork, clone without CLONE_THREAD, execve(at), socket, ptrace,
  unshare/setns, mount APIs, bpf, io_uring, keyrings, modules, reboot and friends return EPERM;
  clone3 returns ENOSYS (glibc then creates threads with clone); kill/tgkill only to itself.
  So: no new processes, no programs run, no sockets of any family; threads still work.
- audit_hook: `sys.addaudithook` raising PermissionError on the same things at the Python level
  (open/listdir/remove/... outside the allowed paths, socket.*, subprocess, os.system/exec/fork/
  spawn, ctypes, signals to other processes). It gives clear errors; it is NOT a security
  boundary on its own (C entry points without audit events, e.g. `_posixsubprocess.fork_exec`,
  or monkeypatching the stdlib it calls, get past it), which is why the kernel layers exist.

Always, whatever the layers: the child gets SIGKILL when the caller's thread that started it
dies (PR_SET_PDEATHSIG), and after the run its whole process group is killed.

A layer the kernel refuses (old kernel, a container's seccomp profile forbidding unshare or
Landlock, AppArmor denying user namespaces) is left out and the others still apply; `layers=`
restricts a run to chosen layers (the tests use it to prove each layer alone). Known limits:
- the program keeps the caller's uid. Without landlock_fs (only the hook guarding files) a
  root caller's program could write root-owned files; run the caller unprivileged if you can;
- without landlock_scope and seccomp, raw syscalls can signal the caller (same uid);
- `os.stat` works on any path: Landlock and the hook guard contents and listings, not metadata;
- disk use is capped per file (16 MB), not in total; CPU seconds count every thread, so a
  multi-threaded busy loop hits the CPU limit before the wall clock;
- pathname UNIX sockets are stopped only by seccomp and the hook (Landlock and netns do not
  cover them); without seccomp or Landlock (not x86_64 / aarch64) only netns, rlimits and the
  hook are left, and the hook can be bypassed;
- without seccomp and the hook, a grandchild that calls setsid escapes the process-group kill.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from typing import Collection, Literal

from agent_core.envs.tools import TOOLS, Tool, ToolResources, ToolResult

_CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")

SANDBOX_LAYERS = (
    "rlimits", "netns", "no_capabilities", "landlock_fs", "landlock_net", "landlock_scope", "seccomp", "audit_hook",
)
KilledBy = Literal["timeout", "memory", "signal"]
MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_OPEN_FILES = 64
MAX_TASKS_IN_NAMESPACE = 32
MIN_MEMORY_MB = 64  # headroom for the interpreter, the bootstrap and a traceback
TRUNCATION_MARKER = "\n[truncated]"
_DRAIN_GRACE_S = 3.0  # how long to wait for the pipes to close once the child is dead


@dataclass(frozen=True)
class SandboxResult:
    """One run. exit_code: the process's exit status, negative for "killed by that signal" (as
    subprocess reports it). timed_out: the wall-clock or CPU limit stopped it. truncated: stdout
    or stderr was cut at max_output_chars. layers: the isolation layers this run actually had."""

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

    def tool_text(self) -> str:
        """What the model sees: stdout, then stderr, then why it stopped if not cleanly."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("stderr:\n" + self.stderr.rstrip("\n"))
        if self.killed_by == "timeout":
            parts.append(f"timed out after {self.timeout_s:g}s")
        elif self.killed_by == "memory":
            parts.append(f"killed: memory limit ({self.memory_mb} MB)")
        elif self.killed_by == "signal":
            parts.append(f"killed by signal {_signal_name(-self.exit_code)}")
        elif self.exit_code != 0:
            parts.append(f"exit code {self.exit_code}")
        return "\n".join(parts) if parts else "(no output)"


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
               layers: Collection[str] | None = None) -> SandboxResult:
    """Run `code` as a program in the sandbox (see the module docstring); never raises for what
    the code does. layers: None for every layer this machine has, or a subset of SANDBOX_LAYERS."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    check_limits(timeout_s, memory_mb, max_output_chars)
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
        return _run_child(workdir, float(timeout_s), memory_mb, max_output_chars, wanted)
    finally:
        _remove_tree(workdir)


def check_limits(timeout_s: float, memory_mb: int, max_output_chars: int) -> None:
    """ValueError naming the first limit that `run_python` would refuse."""
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= MIN_MEMORY_MB):
        raise ValueError(f"memory_mb must be an int >= {MIN_MEMORY_MB}, got {memory_mb!r}")
    if not (isinstance(max_output_chars, int) and max_output_chars >= 1):
        raise ValueError(f"max_output_chars must be an int >= 1, got {max_output_chars!r}")


@cache
def sandbox_layers() -> tuple[str, ...]:
    """The layers this machine gives a run (probed once with an empty program)."""
    return run_python("pass").layers


def _run_child(workdir: str, timeout_s: float, memory_mb: int, max_output_chars: int,
               wanted: tuple[str, ...]) -> SandboxResult:
    status_read, status_write = os.pipe()
    spec = {"layers": list(wanted), "timeout_s": timeout_s, "memory_mb": memory_mb,
            "parent_pid": os.getpid(), "status_fd": status_write}
    command = [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", _CHILD_SCRIPT, json.dumps(spec)]
    environment = {"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    started = time.monotonic()
    try:
        process = subprocess.Popen(command, cwd=workdir, env=environment, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                   pass_fds=(status_write,))
    finally:
        os.close(status_write)
    limit_bytes = 4 * max_output_chars + 4  # UTF-8 needs at most 4 bytes per character
    readers = [_CappedReader(stream, limit_bytes) for stream in (process.stdout, process.stderr)]
    timed_out = not _wait_unreaped(process.pid, timeout_s)
    _kill_group(process.pid)  # also whatever the program left behind in its group
    returncode = process.wait()
    seconds = time.monotonic() - started
    for reader in readers:
        reader.join(_DRAIN_GRACE_S)
    status = _read_status(status_read)
    (stdout, cut_out), (stderr, cut_err) = (reader.text(max_output_chars) for reader in readers)
    timed_out = timed_out or returncode == -signal.SIGXCPU
    killed_by: KilledBy | None = (
        "timeout" if timed_out else "memory" if "memory" in status else "signal" if returncode < 0 else None
    )
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=returncode, timed_out=timed_out,
                         killed_by=killed_by, seconds=seconds, truncated=cut_out or cut_err,
                         layers=tuple(status.get("layers", ())), timeout_s=timeout_s, memory_mb=memory_mb)


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


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _read_status(fd: int) -> dict:
    """The child's status lines: "layers a,b,c" once set up, "memory" on a MemoryError."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass  # a leftover grandchild still holds the write end
    finally:
        os.close(fd)
    status: dict = {}
    for line in data.decode("ascii", errors="replace").splitlines():
        if line.startswith("layers ") and "layers" not in status:
            status["layers"] = [name for name in line[7:].split(",") if name in SANDBOX_LAYERS]
        elif line == "memory":
            status["memory"] = True
    return status


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, failed_path, _exc_info):
        os.chmod(os.path.dirname(failed_path), stat.S_IRWXU)  # the program may have chmod-ed it away
        if os.path.isdir(failed_path) and not os.path.islink(failed_path):
            os.chmod(failed_path, stat.S_IRWXU)
        function(failed_path)

    shutil.rmtree(path, onerror=make_writable_and_retry)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


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

    def __init__(self, *, timeout_s: float, memory_mb: int, max_output_chars: int):
        check_limits(timeout_s, memory_mb, max_output_chars)
        self.limits = {"timeout_s": timeout_s, "memory_mb": memory_mb, "max_output_chars": max_output_chars}
        super().__init__(timeout_s=timeout_s + _TOOL_GRACE_S)

    def execute(self, arguments: dict) -> ToolResult:
        result = run_python(arguments["code"], **self.limits)
        info = {"exit_code": result.exit_code, "killed_by": result.killed_by, "seconds": result.seconds,
                "truncated": result.truncated, "sandbox_layers": list(result.layers)}
        return ToolResult(text=result.tool_text(), info=info)

@TOOLS.register("python")
def make_python_tool(resources: ToolResources, *, timeout_s: float = 5.0, memory_mb: int = 512,
                     max_output_chars: int = 4000) -> PythonTool:
    return PythonTool(timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)
