"""`function_tool`: a `Tool` from a typed Python function with a docstring.

The JSON schema (OpenAI function-calling format) comes from the type hints, the per-parameter
descriptions from a Google-style `Args:` section, the tool description from the docstring's
summary. Re-exported by `agent_core.envs.tools`.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Literal

from agent_core.envs.tool_base import Tool, ToolResult

_SCALAR_SCHEMAS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    list: {"type": "array"},
    dict: {"type": "object"},
}
_JSON_TYPE_OF_LITERAL = {str: "string", int: "integer", float: "number", bool: "boolean"}


class FunctionTool(Tool):
    """A Tool that calls a plain function with the arguments as keywords (built by `function_tool`)."""

    def __init__(self, fn: Callable[..., Any], name: str, description: str, parameters: dict, timeout_s: float | None,
                 implicit_none: tuple[str, ...]):
        self.fn = fn
        self._implicit_none = implicit_none  # `x: T | None` without a default: missing means None
        super().__init__(name=name, description=description, parameters=parameters, timeout_s=timeout_s)

    def execute(self, arguments: dict[str, Any]) -> ToolResult | str:
        filled = {name: None for name in self._implicit_none} | arguments
        result = self.fn(**filled)
        return result if isinstance(result, ToolResult) else str(result)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def function_tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
                  timeout_s: float | None = None) -> Any:
    """Make a `FunctionTool` from `fn`; use as `@function_tool` or `@function_tool(name=..., ...)`.

    Supported hints: str, int, float, bool, list / list[X], dict / dict[str, X], Literal[...] (an
    enum), `X | None` / Optional[X] (nullable and not required). Parameters with defaults are not
    required and carry "default". The schema forbids extra properties. TypeError names the function
    and parameter for a missing or unsupported hint, *args/**kwargs, or an undocumented docstring arg.
    """

    def build(function: Callable[..., Any]) -> FunctionTool:
        parameters, implicit_none, summary = _derive_schema(function)
        tool_description = description if description is not None else summary
        if not tool_description:
            raise TypeError(f"function_tool {function.__qualname__}: needs a docstring or description=")
        return FunctionTool(function, name or function.__name__, tool_description, parameters, timeout_s, implicit_none)

    return build(fn) if fn is not None else build


def _derive_schema(fn: Callable[..., Any]) -> tuple[dict[str, Any], tuple[str, ...], str]:
    where = f"function_tool {fn.__qualname__}"
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise TypeError(f"{where}: cannot resolve type hints: {exc}") from None
    summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    implicit_none: list[str] = []
    signature = inspect.signature(fn)
    for param in signature.parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            kind = param.kind.description
            raise TypeError(f"{where}: parameter {param.name!r} is {kind}; tools take named arguments only")
        if param.name not in hints:
            raise TypeError(f"{where}: parameter {param.name!r} has no type hint")
        schema, nullable = _schema_of(hints[param.name], f"{where}: parameter {param.name!r}")
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        if param.default is not param.empty:
            try:
                schema["default"] = json.loads(json.dumps(param.default, allow_nan=False))
            except (TypeError, ValueError):
                message = f"{where}: parameter {param.name!r} has a default that is not JSON: {param.default!r}"
                raise TypeError(message) from None
        elif nullable:
            implicit_none.append(param.name)
        else:
            required.append(param.name)
        properties[param.name] = schema
    unknown_docs = sorted(set(arg_docs) - set(properties))
    if unknown_docs:
        documented = ", ".join(map(repr, unknown_docs))
        raise TypeError(f"{where}: docstring Args documents {documented}, which the function does not take")
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return parameters, tuple(implicit_none), summary


def _schema_of(hint: Any, where: str) -> tuple[dict[str, Any], bool]:
    """(JSON schema, nullable) for one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        non_null = [arg for arg in args if arg is not type(None)]
        if len(non_null) != 1:
            raise TypeError(f"{where}: unsupported union {hint!r}; only `X | None` (Optional[X]) is supported")
        schema, _ = _schema_of(non_null[0], where)
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
        if isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]
        return schema, True
    if origin is Literal:
        bad = [value for value in args if type(value) not in _JSON_TYPE_OF_LITERAL]
        if bad:
            raise TypeError(f"{where}: Literal values must be str, int, float or bool, got {bad!r}")
        json_types = {_JSON_TYPE_OF_LITERAL[type(value)] for value in args}
        schema = {"type": json_types.pop()} if len(json_types) == 1 else {}
        return schema | {"enum": list(args)}, False
    if origin is list and len(args) == 1:
        return {"type": "array", "items": _schema_of(args[0], where)[0]}, False
    if origin is dict and len(args) == 2 and args[0] is str:
        return {"type": "object", "additionalProperties": _schema_of(args[1], where)[0]}, False
    if hint in _SCALAR_SCHEMAS:
        return dict(_SCALAR_SCHEMAS[hint]), False
    raise TypeError(
        f"{where}: unsupported type {hint!r}; supported: str, int, float, bool, list[X], dict[str, X], "
        "Literal[...], X | None"
    )


_ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
_ARG_ENTRY = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(summary paragraph, {arg: description}) from a Google-style docstring."""
    lines = doc.splitlines()
    summary_lines: list[str] = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line):
            break
        summary_lines.append(line.strip())
    arg_docs: dict[str, str] = {}
    header_at = next((i for i, line in enumerate(lines) if _ARGS_HEADER.match(line)), None)
    if header_at is None:
        return " ".join(summary_lines), arg_docs
    header_indent = len(_ARGS_HEADER.match(lines[header_at]).group(1))
    entry_indent: int | None = None
    current: str | None = None
    for line in lines[header_at + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break  # the next section (Returns:, Raises:, ...)
        entry_indent = indent if entry_indent is None else entry_indent
        entry = _ARG_ENTRY.match(line.strip())
        if indent == entry_indent and entry:
            current = entry.group(1)
            arg_docs[current] = entry.group(2).strip()
        elif current is not None:
            arg_docs[current] = f"{arg_docs[current]} {line.strip()}".strip()
    return " ".join(summary_lines), arg_docs


