"""The tool layer: `Tool`s the policy can call by name, and `execute_call`, which never crashes an episode.

Declare a tool with `@function_tool` on a typed function, or as a `Tool` subclass. `execute_call` turns every
error (unknown tool, bad arguments, an exception, a timeout) into a `ToolCallOutcome` the model sees; a
timed-out tool keeps running in a thread no longer waited for. Tools are registered by name in `TOOLS`;
`Tool`, `ToolResult` and `function_tool` are re-exported here, the one import tool authors need.
Design notes: docs/architecture.md §11 (agent_core/envs/tools.py).
"""

from __future__ import annotations

import contextvars
import json
import math
import threading
import time
import traceback
import typing
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Protocol

from jsonschema import ValidationError

from agent_core.envs.function_tool import FunctionTool, function_tool  # noqa: F401  (re-exported)
from agent_core.envs.tool_base import Tool, ToolResult  # noqa: F401  (re-exported)
from agent_core.registry import Registry

if typing.TYPE_CHECKING:
    from agent_core.envs.search import Bm25Index

# unavailable: too many earlier calls of the tool timed out and still run (MAX_ABANDONED_CALLS_PER_TOOL);
# over_budget: the episode has used its tool calls (ToolEnv's max_tool_calls_per_episode); neither ran.
ERROR_KINDS = ("unknown_tool", "bad_arguments", "exception", "timeout", "unavailable", "over_budget")
ErrorKind = Literal["unknown_tool", "bad_arguments", "exception", "timeout", "unavailable", "over_budget"]
MAX_ABANDONED_CALLS_PER_TOOL = 8


# ---- execute_call: one call, every failure becomes an observation --------------------------------


@dataclass(frozen=True)
class ToolCallOutcome:
    """The result of one tool call as the episode sees it.

    text: what the model sees next (the result, or an error message). reward: the tool's process
    reward, or error_reward for an error. error_kind: None when ok, else one of ERROR_KINDS.
    info: the tool's info plus "truncated_chars"; "traceback" for an exception.
    """

    name: str
    arguments: dict[str, Any]
    ok: bool
    text: str
    reward: float
    error_kind: ErrorKind | None
    latency_s: float
    info: dict[str, Any] = field(default_factory=dict)


class _ToolError(Exception):
    def __init__(self, kind: ErrorKind, message: str, info: dict[str, Any] | None = None):
        super().__init__(message)
        self.kind, self.message, self.info = kind, message, info or {}


def execute_call(tools: Mapping[str, Tool], name: Any, arguments: Any, *, default_timeout_s: float,
                 error_reward: float = 0.0, max_result_chars: int = 4000) -> ToolCallOutcome:
    """Run tool `name` with `arguments`; never raises for anything the model or the tool did.

    The timeout is the tool's `timeout_s`, else `default_timeout_s`. Text longer than
    `max_result_chars` is cut and ends with a "[truncated N chars]" marker (beyond the cap).
    """
    if not default_timeout_s > 0 or max_result_chars < 1:
        raise ValueError(
            f"default_timeout_s must be > 0 and max_result_chars >= 1, got {default_timeout_s}, {max_result_chars}"
        )
    started = time.perf_counter()
    recorded_arguments = arguments if isinstance(arguments, dict) else {}
    try:
        tool = _lookup(tools, name)
        _check_arguments(tool, arguments)
        result = _run_with_timeout(tool, arguments, tool.timeout_s or default_timeout_s)
        ok, text, reward, error_kind, info = True, result.text, float(result.reward), None, dict(result.info)
    except _ToolError as error:
        ok, text, reward, error_kind, info = False, f"Error: {error.message}", error_reward, error.kind, error.info
    text, info["truncated_chars"] = _truncate(text, max_result_chars)
    return ToolCallOutcome(
        name=str(name), arguments=recorded_arguments, ok=ok, text=text, reward=reward,
        error_kind=error_kind, latency_s=time.perf_counter() - started, info=info,
    )


def _lookup(tools: Mapping[str, Tool], name: Any) -> Tool:
    if isinstance(name, str) and name in tools:
        return tools[name]
    available = ", ".join(sorted(tools)) or "(none)"
    raise _ToolError("unknown_tool", f"unknown tool {name!r}. Available tools: {available}")


def _check_arguments(tool: Tool, arguments: Any) -> None:
    if not isinstance(arguments, dict):
        message = f"arguments for tool {tool.name!r} must be a JSON object, got {_json_type(arguments)}"
        raise _ToolError("bad_arguments", message)
    try:
        errors = sorted(tool.validation_errors(arguments), key=lambda error: list(map(str, error.absolute_path)))
    except Exception as exc:  # noqa: BLE001 - e.g. an unresolvable $ref in the tool's own schema
        raise _ToolError("exception", f"tool {tool.name!r} could not check its arguments: {type(exc).__name__}: {exc}")
    if errors:
        problems = "; ".join(dict.fromkeys(_describe(error) for error in errors[:3]))
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise _ToolError("bad_arguments", f"invalid arguments for tool {tool.name!r}: {problems}{more}")


def _describe(error: ValidationError) -> str:
    """One short, readable line per schema violation (not jsonschema's full dump)."""
    where = "argument " + repr(".".join(map(str, error.absolute_path))) if error.absolute_path else "arguments"
    if error.validator == "required":
        missing = [key for key in error.validator_value if key not in error.instance]
        return f"missing required argument {', '.join(map(repr, missing))}"
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(error.schema.get("properties", {}))
        extra = sorted(key for key in error.instance if key not in allowed)
        return f"unexpected argument {', '.join(map(repr, extra))} (valid: {', '.join(sorted(allowed)) or 'none'})"
    if error.validator == "type":
        expected = error.validator_value
        expected = expected if isinstance(expected, str) else " or ".join(expected)
        return f"{where} must be {expected}, got {_json_type(error.instance)} {_short(error.instance)}"
    if error.validator == "enum":
        return f"{where} must be one of {', '.join(map(_short, error.validator_value))}; got {_short(error.instance)}"
    return f"{where}: {_short(error.instance)} fails {error.validator} {_short(error.validator_value)}"


def _json_type(value: Any) -> str:
    for python_type, json_type in ((bool, "boolean"), (str, "string"), (int, "integer"), (float, "number"),
                                   (list, "array"), (dict, "object"), (type(None), "null")):
        if isinstance(value, python_type):
            return json_type
    return type(value).__name__


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_abandoned_lock = threading.Lock()
_abandoned: Counter[str] = Counter()  # tool name -> timed-out calls whose thread is still running


def abandoned_calls(name: str) -> int:
    """How many timed-out calls of tool `name` are still running in the background."""
    with _abandoned_lock:
        return _abandoned[name]


def _run_with_timeout(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
    # A daemon thread per call (not a shared executor): executor threads are joined at interpreter
    # exit, so one stuck tool would hang the process; a daemon thread is simply abandoned. The
    # caller (an env worker) is free again after timeout_s however long the tool runs, so hung
    # tools cannot starve the env pool; bounding the abandoned threads per tool keeps a tool that
    # always hangs from piling up threads without limit (its calls then fail at once).
    with _abandoned_lock:
        stuck = _abandoned[tool.name]
        if stuck >= MAX_ABANDONED_CALLS_PER_TOOL:
            message = (f"tool {tool.name!r} is unavailable: {stuck} earlier calls timed out and are still "
                       "running; try another tool or answer")
            raise _ToolError("unavailable", message, {"abandoned_calls": stuck})
    future: Future = Future()
    state = {"finished": False, "abandoned": False}

    def run() -> None:
        try:
            future.set_result(tool.execute(arguments))
        except BaseException as exc:  # noqa: BLE001 - whatever the tool does, the episode goes on
            future.set_exception(exc)
        finally:
            with _abandoned_lock:
                state["finished"] = True
                if state["abandoned"]:
                    _abandoned[tool.name] -= 1

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name=f"tool-{tool.name}", daemon=True).start()
    try:
        # exception() rather than result(): a KeyboardInterrupt in *this* thread must propagate.
        exc = future.exception(timeout=None if math.isinf(timeout_s) else timeout_s)
    except FutureTimeoutError:
        with _abandoned_lock:
            if not state["finished"]:
                state["abandoned"] = True
                _abandoned[tool.name] += 1
        message = f"tool {tool.name!r} timed out after {timeout_s:g} s"
        raise _ToolError("timeout", message, {"timeout_s": timeout_s}) from None
    if exc is not None:
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        raise _ToolError("exception", f"{type(exc).__name__}: {_exception_text(exc)}", {"traceback": trace})
    result = future.result()
    if isinstance(result, str):
        return ToolResult(text=result)
    if not isinstance(result, ToolResult):
        message = f"TypeError: tool {tool.name!r} returned {type(result).__name__}; expected ToolResult or str"
        raise _ToolError("exception", message)
    return result


def _exception_text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a tool's own exception class whose __str__ fails
        return "(the exception's message could not be read)"


def _truncate(text: str, max_chars: int) -> tuple[str, int]:
    cut = len(text) - max_chars
    return (text, 0) if cut <= 0 else (f"{text[:max_chars]}\n[truncated {cut} chars]", cut)


# ---- the registry of tool factories ----------------------------------------------------------------


class ToolResources(Protocol):
    """What tool factories may use (agent_core.envs.registry.EnvResources satisfies it)."""

    @property
    def search_index(self) -> Bm25Index | None: ...  # read-only, so frozen dataclasses qualify


ToolFactory = Callable[..., Tool]  # (resources: ToolResources, **kwargs) -> Tool

TOOLS: Registry[ToolFactory] = Registry("tool")


def tool_kwarg_names(name: str) -> list[str]:
    """The keyword arguments tool factory `name` accepts (UnknownNameError for an unknown tool)."""
    return TOOLS.kwarg_names(name)


def make_tool(name: str, kwargs: Mapping[str, Any], resources: ToolResources) -> Tool:
    """Build registered tool `name` with `kwargs`; TypeError names the tool and valid kwargs on a bad key."""
    TOOLS.check_kwargs(name, kwargs)
    return TOOLS.get(name)(resources, **kwargs)

