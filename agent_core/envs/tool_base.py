"""What a tool is: `Tool` (name, description, JSON-schema parameters, `execute`) and `ToolResult`.

The declaration is checked when a tool is built, so a bad tool fails where it is defined rather
than on the model's first call. Kept apart from `agent_core.envs.tools` (calling tools, the
registry) so that `function_tool` and the tool implementations can build on it without importing
the module that re-exports them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator, SchemaError, ValidationError

TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns. reward: a process reward for this call; info: kept in the steps table."""

    text: str
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"ToolResult.text must be a str, got {type(self.text).__name__}")
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"ToolResult.reward must be a finite number, got {self.reward!r}")


class Tool:
    """A callable capability the policy invokes by name with JSON arguments.

    Subclasses set `name`, `description`, `parameters` (and optionally `timeout_s`) as class
    attributes or pass them to `__init__`, and implement `execute`. `execute` receives arguments
    already validated against `parameters`; returning a str means `ToolResult(text=...)`.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    timeout_s: float | None = None  # None: execute_call's default_timeout_s applies

    def __init__(
        self,
        name: str | None = None,
        description: str | None = None,
        parameters: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ):
        self.name = name if name is not None else getattr(self, "name", None)
        self.description = description if description is not None else getattr(self, "description", None)
        self.parameters = parameters if parameters is not None else getattr(self, "parameters", None)
        self.timeout_s = timeout_s if timeout_s is not None else getattr(self, "timeout_s", None)
        self._validator = _checked_declaration(self)

    def execute(self, arguments: dict[str, Any]) -> ToolResult | str:
        raise NotImplementedError(f"tool {self.name!r} ({type(self).__name__}) does not implement execute()")

    def spec(self) -> dict[str, Any]:
        """The OpenAI function-calling declaration (what chat templates render into the system prompt)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validation_errors(self, arguments: Any) -> list[ValidationError]:
        return list(self._validator.iter_errors(arguments))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _checked_declaration(tool: Tool) -> Draft202012Validator:
    where = f"tool {tool.name!r} ({type(tool).__name__})"
    if not isinstance(tool.name, str) or not TOOL_NAME_PATTERN.match(tool.name):
        raise ValueError(f"{where}: name must match {TOOL_NAME_PATTERN.pattern} (letters, digits, _ and -, at most 64)")
    if not isinstance(tool.description, str) or not tool.description.strip():
        raise ValueError(f"{where}: description must be a non-empty string (the model reads it to pick the tool)")
    timeout_ok = isinstance(tool.timeout_s, (int, float)) and not isinstance(tool.timeout_s, bool) and tool.timeout_s > 0
    if tool.timeout_s is not None and not timeout_ok:
        raise ValueError(f"{where}: timeout_s must be a positive number of seconds or None, got {tool.timeout_s!r}")
    if not isinstance(tool.parameters, dict) or tool.parameters.get("type") != "object":
        raise ValueError(
            f"{where}: parameters must be a JSON schema dict with \"type\": \"object\", got {tool.parameters!r}"
        )
    try:
        _check_schema(tool.parameters)
    except SchemaError as exc:
        path = "/".join(map(str, exc.absolute_path)) or "(root)"
        raise ValueError(f"{where}: parameters is not a valid JSON schema at {path}: {exc.message}") from None
    return Draft202012Validator(tool.parameters)


_VALID_SCHEMAS: set[str] = set()  # JSON texts of parameter schemas that passed check_schema


def _check_schema(parameters: dict[str, Any]) -> None:
    """Draft202012Validator.check_schema, once per distinct schema.

    Checking a schema against the metaschema costs ~10 ms, and envs build their tools once per
    episode: without the memo, building 1,000 episodes' search tools took ~10 s of a rollout.
    """
    try:
        key = json.dumps(parameters, sort_keys=True)
    except (TypeError, ValueError):  # not JSON (e.g. a set inside): check it every time
        key = None
    if key is None or key not in _VALID_SCHEMAS:
        Draft202012Validator.check_schema(parameters)
        if key is not None:
            _VALID_SCHEMAS.add(key)
