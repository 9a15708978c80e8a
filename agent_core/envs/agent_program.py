"""Run an existing agent program once per prompt: the process side of env `agent_program`.

Each run gets the prompt as JSON on stdin, the gateway's URL and its episode's token in the
environment, and must print `{"answer": ...}` as its last stdout line (the whole contract:
docs/guides/train-your-agent.md). Every fault of the program is a failed outcome with a one-line
reason, never an exception; after every run its process group is killed. With a `ProgramJail` it
runs through `program_jail.py` (own user, mount and PID namespaces, private /proc, the data root
hidden but for the corpus); `ProgramOutcome.jail` says which layers it got. stdout and stderr
are drained as written, keeping only their last `max_output_bytes`.
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

# Waiting without reaping keeps the pid (= the group id) from being reused before the group is killed.
from agent_core.envs.processes import kill_group, signal_name, wait_unreaped

ENV_NAME = "agent_program"
STDERR_TAIL_BYTES = 2048
TERM_GRACE_S = 1.0  # between SIGTERM and SIGKILL of a program past its limit
_DRAIN_GRACE_S = 2.0  # how long to wait for the pipes to reach EOF once the group is dead
_REASON_CHARS = 300  # of stderr or stdout quoted in a failure line
_JAIL_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "program_jail.py")


@dataclass(frozen=True)
class ProgramSpec:
    """How to run the program, from `rollout.env_kwargs` of env agent_program (see from_env_kwargs)."""

    command: tuple[str, ...]
    timeout_s: float = 60.0
    max_parallel: int = 4
    max_output_bytes: int = 1_000_000

    @classmethod
    def from_env_kwargs(cls, kwargs: Mapping[str, Any]) -> "ProgramSpec":
        """ValueError (one line, naming the key) unless `kwargs` is a valid spec: command is a
        non-empty list of strings, timeout_s a positive finite number, max_parallel and
        max_output_bytes positive ints; no other keys."""
        where = f"env {ENV_NAME!r}: env_kwargs"
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"{where} must be a mapping with at least `command`, got {kwargs!r}")
        unknown = sorted(set(kwargs) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"valid keys: {', '.join(_FIELDS)}")
        if "command" not in kwargs:
            raise ValueError(f"{where}.command is required: the program's argv as a list, "
                             "e.g. {command: [python, examples/openai_agent/agent.py]}")
        command = kwargs["command"]
        if isinstance(command, str) or not isinstance(command, Sequence) or not command or not all(
                _argv_part(part) for part in command):
            raise ValueError(f"{where}.command must be a non-empty list of non-empty strings (the argv, "
                             f"e.g. [python, agent.py]), got {command!r}")
        timeout_s = kwargs.get("timeout_s", cls.timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"{where}.timeout_s must be a positive number of seconds, got {timeout_s!r}")
        counts = {key: kwargs.get(key, getattr(cls, key)) for key in ("max_parallel", "max_output_bytes")}
        for key, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}.{key} must be an int >= 1, got {value!r}")
        return cls(command=tuple(map(_argv_part, command)), timeout_s=float(timeout_s), **counts)


    def missing(self, cwd: str) -> str | None:
        """Why the command cannot start from `cwd` (where programs run: the directory agentr1 runs in),
        one line, or None: its executable is not found, or the script an interpreter is given is not."""
        exe = self.command[0]
        if os.sep in exe and not os.path.isfile(os.path.join(cwd, exe)):
            return f"{exe} is not a file (a relative path is resolved against {cwd}, where agentr1 runs)"
        if os.sep not in exe and shutil.which(exe) is None:
            return f"{exe!r} is not on PATH"
        script = _script_of(self.command)
        if script is not None and not os.path.isfile(os.path.join(cwd, script)):
            return (f"{exe} would run {script}, which is not a file (a relative path is resolved against {cwd}, "
                    "where agentr1 runs: give an absolute path, or run agentr1 from the folder it is relative to)")
        return None


_FIELDS = ("command", "timeout_s", "max_parallel", "max_output_bytes")
_INTERPRETERS = ("python", "node", "bash", "sh", "ruby", "perl")


def _script_of(command: Sequence[str]) -> str | None:
    """The script file an interpreter's argv runs (`python agent.py`), None for `-c`/`-m` or no interpreter."""
    if not os.path.basename(command[0]).startswith(_INTERPRETERS):
        return None
    args = iter(command[1:])
    for arg in args:
        if arg in ("-c", "-m", "-e", "--eval"):
            return None
        if arg in ("-X", "-W"):  # python's options that take a value
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def _argv_part(part: Any) -> str:
    """`part` as an argv string, "" if it cannot be one. Numbers are taken as written: YAML reads the
    4 of `[agent.py, --max-turns, 4]` as an int. Booleans are not (YAML's `yes`, `on` are ambiguous)."""
    if isinstance(part, str):
        return part
    if isinstance(part, (int, float)) and not isinstance(part, bool):
        return str(part)
    return ""


@dataclass(frozen=True)
class ProgramJail:
    """What a jailed program may not see (`hide`: directories covered by an empty read-only tmpfs,
    e.g. the data root) and may read beneath them (`expose`: files or directories bound back
    read-only at their own paths, e.g. the corpus). Absolute paths."""

    hide: tuple[str, ...] = ()
    expose: tuple[str, ...] = ()

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
    """One run of the program for `job` (see the module docstring); never raises for its faults."""
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
        argv = list(spec.command) if jail is None else _jailed(spec.command, jail, status_write)
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=_environment(job.env), start_new_session=True,
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


def _jailed(command: Sequence[str], jail: ProgramJail, status_fd: int) -> list[str]:
    """The argv that runs `command` inside program_jail.py (stdlib only: `-I -S`, no site-packages)."""
    spec = {"argv": list(command), "hide": list(jail.hide), "expose": list(jail.expose), "cwd": os.getcwd(),
            "status_fd": status_fd}
    return [sys.executable, "-I", "-S", "-B", _JAIL_SCRIPT, json.dumps(spec)]


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
    """The answer line's optional "agent_rewards" ({agent name: finite number}: a reward of each named
    agent's own, on top of the answer's score they share), or ({}, a one-line reason)."""
    value = json.loads([line for line in stdout.splitlines() if line.strip()][-1])
    rewards = value.get("agent_rewards", {})
    if not isinstance(rewards, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in rewards.items()):
        return {}, f"agent_rewards must map agent names to finite numbers, got {_quote(json.dumps(rewards))}"
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


def _environment(extra: Mapping[str, str]) -> dict[str, str]:
    environment = {**os.environ, **{str(key): str(value) for key, value in extra.items()}}
    # Popen looks argv[0] up on the child's PATH: `python` is then this interpreter, with the project
    interpreter_dir = os.path.dirname(sys.executable)
    environment["PATH"] = os.pathsep.join(part for part in (interpreter_dir, environment.get("PATH", "")) if part)
    return environment


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
