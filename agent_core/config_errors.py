"""Config errors in one line: the key, the value, where the value was set, and what is allowed.

A config is layered (embedded defaults, then YAML files, then `--set key=value` overrides), so an
error names the layer that set the bad value: a mistyped `--set` blames the override, not the
file underneath it. pydantic's report (an error count, `[type=...]`, a documentation link per
error) is cut down to the field, the value and the constraint or valid choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

MAX_VALUE_CHARS = 60


class ConfigError(ValueError):
    """A configuration that cannot be loaded; the message names the key and the valid choices."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: the dotted key and what is wrong with it."""

    key: str
    message: str


class Override(str):
    """A `key=value` override that remembers how an error should name it: who typed it and how
    (`--data-root /x`, `deployment parameter overrides: seed=abc`). It is the plain string everywhere
    else; a plain string is a `--set`."""

    blame: str

    def __new__(cls, item: str, blame: str) -> "Override":
        override = super().__new__(cls, item)
        override.blame = blame
        return override


def deployment_overrides(items: Sequence[str], parameter: str = "overrides") -> list[Override]:
    """`items`, given to a deployment's flow as its `parameter`, blamed as such (a worker's log says
    which parameter of the deployment run to fix; there is no --set to blame)."""
    return [Override(item, f"deployment parameter {parameter}: {item}") for item in items]


def value_origin(key: str, source: str, overrides: Sequence[str] = ()) -> str:
    """Which layer set `key`: the last override naming it (or a section above or below it), as its
    `blame` (`--set <item>` for a plain string), else `source`."""
    for item in reversed(overrides):
        set_key = item.partition("=")[0].strip()
        if set_key and (key == set_key or key.startswith(f"{set_key}.") or set_key.startswith(f"{key}.")):
            return getattr(item, "blame", f"--set {item}")
    return source


def config_error(problems: Sequence[Problem], source: str = "config", overrides: Sequence[str] = ()) -> ConfigError:
    """One ConfigError for all `problems`, each told once, on one line."""
    told = []
    for problem in problems:
        origin = value_origin(problem.key, source, overrides)
        where = "" if origin == "config" else f" (set by {origin})"
        told.append(f"{problem.key}{where}: {problem.message}")
    return ConfigError("invalid config: " + "; ".join(told))


def validation_problems(error: ValidationError) -> list[Problem]:
    """pydantic's errors as Problems: `rollout.group_size: 'abc' is not a valid integer ...`."""
    problems = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "config"
        problems.append(Problem(key, _constraint(item)))
    return problems


def _constraint(item: dict) -> str:
    message = str(item["msg"])
    if message.startswith("Value error, "):  # a validator's own sentence: already says what is wrong
        return message.removeprefix("Value error, ")
    if item["type"] == "model_type":
        return f"got {_shown(item.get('input'))}; it must be a section (a mapping of keys)"
    if message.startswith("Input should be "):
        return f"got {_shown(item.get('input'))}; it must be {message.removeprefix('Input should be ')}"
    return f"got {_shown(item.get('input'))}: {message}"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."
