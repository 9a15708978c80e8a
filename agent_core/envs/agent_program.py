"""Run an existing agent program once per prompt: the process side of env `agent_program`.

Each run gets the prompt as JSON on stdin, the gateway's URL and its episode's token in the
environment, and must print `{"answer": ...}` as its last stdout line (the whole contract:
docs/guides/train-your-agent.md). Every fault of the program is a failed outcome with a one-line
reason, never an exception; after every run its process group is killed. With a `ProgramJail` it
runs through `program_jail.py` (own namespaces, its gateway the only thing on its network, the
file system read-only but for its scratch folder, the data root hidden but for the corpus);
`ProgramOutcome.jail` says which layers it got. Its environment is a documented minimum
(`_environment`). stdout and stderr are drained as written, keeping only their last `max_output_bytes`.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

# Waiting without reaping keeps the pid (= the group id) from being reused before the group is killed.
from agent_core.envs.processes import kill_group, signal_name, wait_unreaped
from agent_core.envs.program_spec import ProgramSpec

STDERR_TAIL_BYTES = 2048
TERM_GRACE_S = 1.0  # between SIGTERM and SIGKILL of a program past its limit
_DRAIN_GRACE_S = 2.0  # how long to wait for the pipes to reach EOF once the group is dead
_REASON_CHARS = 300  # of stderr or stdout quoted in a failure line
_JAIL_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "program_jail.py")
# what every program gets of the caller's environment (besides its gateway's variables and `env`)
BASE_ENVIRONMENT = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
AGENT_REWARD_BOUND = 100.0  # |agent_rewards| a program may give: a task's own score is in [0, 1]


@dataclass(frozen=True)
class ProgramJail:
    """What a jailed program may not see (`hide`: directories covered by an empty read-only tmpfs,
    e.g. the data root) and may read beneath them (`expose`: files or directories bound back
    read-only at their own paths, e.g. the corpus). Absolute paths."""

    hide: tuple[str, ...] = ()
    expose: tuple[str, ...] = ()
    gateway_port: int | None = None  # the port forwarded, inside the jail's network, to gateway_socket
    gateway_socket: str | None = None

    @classmethod
    def around(cls, hide: Sequence[str | os.PathLike], expose: Sequence[str | os.PathLike | None] = ()) -> "ProgramJail":
        """Resolved (symlinks too: a mount covers the real directory) and without missing paths."""
        real = (lambda paths: tuple(dict.fromkeys(os.path.realpath(p) for p in paths if p and os.path.exists(p))))
        return cls(real(hide), real(expose))


@dataclass(frozen=True)
class JailReport:
    """The layers a jailed run got (program_jail.LAYERS) and, for each one refused, the kernel's reason."""

    layers: tuple[str, ...]
    refused: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ProgramJob:
    """One run. key: the episode id. stdin: the JSON object written to its stdin. env: variables
    added to the caller's environment."""

    key: str
    stdin: dict[str, Any]
    env: dict[str, str]


@dataclass(frozen=True)
class ProgramOutcome:
    """How one run ended. answer: from the last stdout line (None on failure). failure: None if it
    ended well, else one line saying why. returncode: negative for a signal, None if never started."""

    key: str
    answer: str | None
    failure: str | None
    returncode: int | None
    seconds: float
    stderr_tail: str
    jail: JailReport | None = None
    agent_rewards: Mapping[str, float] = field(default_factory=dict)  # "agent_rewards" of the answer line


def run_programs(spec: ProgramSpec, jobs: Sequence[ProgramJob],
                 on_done: Callable[[ProgramOutcome], None] | None = None,
                 jail: ProgramJail | None = None,
                 on_start: Callable[[ProgramJob], None] | None = None) -> list[ProgramOutcome]:
    """Run every job, at most spec.max_parallel at once, each in `jail` when one is given; call
    on_start just before each program starts and on_done as each ends (both from a worker thread);
    return the outcomes in job order. Never raises for a program's fault (an exception raised by
    on_start or on_done itself is re-raised here, after every job has ended)."""
    if not jobs:
        return []

    def run_and_report(job: ProgramJob) -> ProgramOutcome:
        if on_start is not None:
            on_start(job)
        outcome = run_program(spec, job, jail)
        if on_done is not None:
            on_done(outcome)
        return outcome

    with ThreadPoolExecutor(max_workers=min(spec.max_parallel, len(jobs)),
                            thread_name_prefix="agent-program") as pool:
        futures = [pool.submit(run_and_report, job) for job in jobs]
    return [future.result() for future in futures]


def run_program(spec: ProgramSpec, job: ProgramJob, jail: ProgramJail | None = None) -> ProgramOutcome:
    """One run of the program for `job` (see the module docstring); never raises for its faults. Its
    private scratch folder (HOME, TMPDIR; a tmpfs when jailed) is removed when it ends."""
    scratch = tempfile.mkdtemp(prefix="agentr1-program-")
    try:
        os.mkdir(os.path.join(scratch, "home"))
        return _run(spec, job, jail, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(spec: ProgramSpec, job: ProgramJob, jail: ProgramJail | None, scratch: str) -> ProgramOutcome:
    started = time.monotonic()
    report: JailReport | None = None

    def failed(reason: str, returncode: int | None = None, stderr: str = "") -> ProgramOutcome:
        return ProgramOutcome(job.key, None, reason, returncode, time.monotonic() - started, stderr, report)

    try:
        payload = (json.dumps(job.stdin, ensure_ascii=False) + "\n").encode("utf-8")
    except (TypeError, ValueError) as error:
        return failed(f"the prompt could not be written as JSON for the program's stdin: {error}")
    status_read, status_write = os.pipe() if jail is not None else (None, None)
    try:
        argv = list(spec.command) if jail is None else _jailed(spec, jail, status_write, scratch)
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=_environment(spec, job.env, scratch), start_new_session=True,
                                   pass_fds=() if status_write is None else (status_write,))
    except (OSError, ValueError) as error:
        if status_read is not None:
            os.close(status_read)
        return failed(f"could not start {spec.command[0]!r}: {_one_line(str(error))}")
    finally:
        if status_write is not None:
            os.close(status_write)
    stdout, stderr = (_TailReader(stream, spec.max_output_bytes) for stream in (process.stdout, process.stderr))
    threading.Thread(target=_feed, args=(process.stdin, payload), daemon=True).start()
    if status_read is not None:
        report = _read_jail_report(status_read, spec.timeout_s)
    timed_out = not wait_unreaped(process.pid, max(0.0, spec.timeout_s - (time.monotonic() - started)))
    if timed_out:
        _terminate_group(process.pid)
    kill_group(process.pid)  # also whatever the program left running in its group
    returncode = process.wait()
    for reader in (stdout, stderr):
        reader.join(_DRAIN_GRACE_S)
    stderr_text = stderr.text()
    stderr_tail = stderr_text[-STDERR_TAIL_BYTES:]
    if timed_out:
        return failed(f"timed out after {spec.timeout_s:g} s (process group killed)", returncode, stderr_tail)
    if returncode != 0:
        what = f"killed by signal {signal_name(-returncode)}" if returncode < 0 else f"exit code {returncode}"
        return failed(f"{what}: {_tail_line(stderr_text) or '(no stderr)'}", returncode, stderr_tail)
    answer, problem = parse_answer(stdout.text())
    rewards, reward_problem = parse_agent_rewards(stdout.text()) if problem is None else ({}, None)
    if problem is not None or reward_problem is not None:
        dropped = f" (stdout over {spec.max_output_bytes} bytes, only its end kept)" if stdout.dropped else ""
        return failed((problem or reward_problem) + dropped, returncode, stderr_tail)
    return ProgramOutcome(job.key, answer, None, returncode, time.monotonic() - started, stderr_tail, report,
                          rewards)


def _jailed(spec: ProgramSpec, jail: ProgramJail, status_fd: int, scratch: str) -> list[str]:
    """The argv that runs the program inside program_jail.py (stdlib only: `-I -S`, no site-packages)."""
    settings = {"argv": list(spec.command), "hide": list(jail.hide), "expose": list(jail.expose),
                "cwd": os.getcwd(), "status_fd": status_fd, "scratch": scratch, "scratch_mb": spec.scratch_mb,
                "host_network": spec.network == "host", "gateway_port": jail.gateway_port,
                "gateway_socket": jail.gateway_socket}
    return [sys.executable, "-I", "-S", "-B", _JAIL_SCRIPT, json.dumps(settings)]


def _read_jail_report(status_read: int, timeout_s: float) -> JailReport:
    """The jail's one status line, read before the program's output matters; a jail that died
    before writing it (killed, out of memory) reads as no layers."""
    text, deadline = b"", time.monotonic() + timeout_s
    try:
        while not text.endswith(b"\n") and select.select([status_read], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(status_read, 4096)
            if not chunk:
                break
            text += chunk
    finally:
        os.close(status_read)
    try:
        status = json.loads(text)
        return JailReport(tuple(status["layers"]), tuple(sorted(status["refused"].items())))
    except (ValueError, KeyError, TypeError, AttributeError):
        return JailReport((), (("all", "the jail ended before it reported its layers"),))


def parse_agent_rewards(stdout: str) -> tuple[dict[str, float], str | None]:
    """The answer line's optional "agent_rewards" ({agent name: number within AGENT_REWARD_BOUND}: a
    reward of each named agent's own, on top of the answer's score they share), or ({}, a one-line
    reason): a value past the bound fails the episode, so no number a program prints can overflow a
    later stage's returns or advantages."""
    value = json.loads([line for line in stdout.splitlines() if line.strip()][-1])
    rewards = value.get("agent_rewards", {})
    if not isinstance(rewards, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and abs(v) <= AGENT_REWARD_BOUND for k, v in rewards.items()):
        return {}, (f"agent_rewards must map agent names to numbers in [-{AGENT_REWARD_BOUND:g}, "
                    f"{AGENT_REWARD_BOUND:g}], got {_quote(json.dumps(rewards))}")
    return {k: float(v) for k, v in rewards.items()}, None


def parse_answer(stdout: str) -> tuple[str | None, str | None]:
    """(answer, None) from the last non-empty line of `stdout` when it is a JSON object with a
    string "answer"; else (None, a one-line reason)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None, "no JSON answer: stdout was empty (print {\"answer\": ...} as the last line)"
    last = lines[-1].strip()
    try:
        value = json.loads(last)
    except ValueError:
        return None, f"no JSON answer on the last stdout line: {_quote(last)}"
    if not isinstance(value, dict) or not isinstance(value.get("answer"), str):
        return None, f"the last stdout line is not a JSON object with a string \"answer\": {_quote(last)}"
    return value["answer"], None


def _environment(spec: ProgramSpec, extra: Mapping[str, str], scratch: str) -> dict[str, str]:
    """The documented minimum, never the caller's whole environment (its credentials): PATH, HOME and
    TMPDIR in scratch, the locale, the variables `spec.env` names, and `extra` (the gateway's)."""
    kept = {name: os.environ[name] for name in (*BASE_ENVIRONMENT, *spec.env) if name in os.environ}
    # Popen looks argv[0] up on the child's PATH: `python` is then this interpreter, with the project
    interpreter_dir = os.path.dirname(sys.executable)
    path = os.pathsep.join(part for part in (interpreter_dir, os.environ.get("PATH", "")) if part)
    return {**kept, "PATH": path, "HOME": os.path.join(scratch, "home"), "TMPDIR": scratch,
            **{str(key): str(value) for key, value in extra.items()}}


def _feed(stdin, payload: bytes) -> None:
    """Write the prompt and close stdin, in its own thread: a program that never reads its stdin
    must not block the caller on a full pipe."""
    try:
        with stdin:
            stdin.write(payload)
    except (BrokenPipeError, OSError, ValueError):
        pass  # the program exited or closed stdin without reading it: its own business


def _terminate_group(pgid: int) -> None:
    """SIGTERM to the group (a chance to clean up), then wait for the leader up to TERM_GRACE_S;
    the caller's SIGKILL follows in any case."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    wait_unreaped(pgid, TERM_GRACE_S)


class _TailReader(threading.Thread):
    """Drains one pipe to EOF, keeping its last `limit` bytes (a flood of output never fills the
    caller's memory, and the last line, the answer, is what is kept)."""

    def __init__(self, stream, limit: int):
        super().__init__(daemon=True)  # a grandchild holding the pipe must not hang the caller
        self.stream, self.limit, self.kept, self.dropped = stream, limit, bytearray(), 0
        self.lock = threading.Lock()
        self.start()

    def run(self) -> None:
        with self.stream:
            while chunk := self.stream.read1(65536):
                with self.lock:
                    self.kept += chunk
                    if len(self.kept) > self.limit:
                        excess = len(self.kept) - self.limit
                        del self.kept[:excess]
                        self.dropped += excess

    def text(self) -> str:
        with self.lock:
            return bytes(self.kept).decode("utf-8", errors="replace")


def _tail_line(text: str) -> str:
    """The end of `text` as one line: its last non-empty lines joined, at most _REASON_CHARS."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    joined = " | ".join(lines[-3:])
    return joined if len(joined) <= _REASON_CHARS else "..." + joined[-_REASON_CHARS:]


def _quote(text: str) -> str:
    return repr(text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS] + "...")


def _one_line(text: str) -> str:
    return " ".join(text.split())
