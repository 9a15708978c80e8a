"""How an agent program is run: `ProgramSpec`, read from `rollout.env_kwargs` of env `agent_program`
and checked there (one line naming the key); agent_program.py runs it."""

from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

ENV_NAME = "agent_program"


@dataclass(frozen=True)
class ProgramSpec:
    """How to run the program, from `rollout.env_kwargs` of env agent_program (see from_env_kwargs)."""

    command: tuple[str, ...]
    timeout_s: float = 60.0
    max_parallel: int = 4
    max_output_bytes: int = 1_000_000
    env: tuple[str, ...] = ()  # names of the caller's environment variables the program also gets
    network: str = "gateway"  # "gateway": its gateway alone; "host": the host's network (jailed runs)
    scratch_mb: int = 256  # size of its private writable folder (HOME, TMPDIR), a tmpfs when jailed

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
        counts = {key: kwargs.get(key, getattr(cls, key)) for key in ("max_parallel", "max_output_bytes", "scratch_mb")}
        for key, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}.{key} must be an int >= 1, got {value!r}")
        env = kwargs.get("env", [])
        if isinstance(env, str) or not isinstance(env, Sequence) or not all(
                isinstance(name, str) and _ENV_NAME.fullmatch(name) for name in env):
            raise ValueError(f"{where}.env must be a list of environment variable names the program also gets "
                             f"(e.g. [HF_HOME, MY_API_KEY]), got {env!r}")
        network = kwargs.get("network", cls.network)
        if network not in NETWORKS:
            raise ValueError(f"{where}.network must be one of {', '.join(NETWORKS)} ('gateway': a jailed program "
                             f"reaches its gateway alone; 'host': the host's network too), got {network!r}")
        return cls(command=tuple(map(_argv_part, command)), timeout_s=float(timeout_s), env=tuple(env),
                   network=network, **counts)


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


_FIELDS = ("command", "timeout_s", "max_parallel", "max_output_bytes", "env", "network", "scratch_mb")
NETWORKS = ("gateway", "host")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
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

