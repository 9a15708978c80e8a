"""The hermes tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The Hermes / Qwen2.5 convention: the model writes one JSON object per call inside `<tool_call>`
tags, and results come back inside `<tool_response>` tags (as "tool" messages where the chat
template has a tool role, which Qwen2.5's wraps as `<|im_start|>user\\n<tool_response>...`).

Where it differs from vLLM's hermes parser: an unclosed `<tool_call>` at the end of the text is an
error here ("unclosed_tag"), not a call, so a truncated action never runs a half-written call; a
call whose JSON is malformed is reported and the other calls in the action still run; the final
answer is `<answer>text</answer>` (Agent-R1's convention), read by the rule in actions.py. Like
vLLM, "arguments" may be a JSON string that holds an object; a missing "arguments" means {}.
Names are not checked against the tools here: the env answers an unknown name with the valid ones.
"""

from __future__ import annotations

import json
from typing import Any, Collection, Mapping, Sequence

from agent_core.envs.formats.actions import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    DEFAULT_MAX_CALL_CHARS,
    FORMATS,
    ActionError,
    ParsedAction,
    ParsedCall,
    check_max_call_chars,
    read_action,
    tool_function,
)
from agent_core.types import ChatMessage

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# Qwen2.5's chat template text around the tool list (its "tools" branch), so a template without
# tools= support shows the model the same instructions that Qwen2.5 shows.
_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
ANSWER_INSTRUCTIONS = (
    f"When you know the final answer, write it outside any tool call as {ANSWER_OPEN}your answer{ANSWER_CLOSE}."
)


@FORMATS.register("hermes")
class HermesFormat:
    """Reads and writes hermes calls. tool_specs are optional (used only to check them at setup)."""

    name = "hermes"
    answer_instructions = ANSWER_INSTRUCTIONS

    def __init__(self, tool_specs: Sequence[Mapping[str, Any]] = (), *, max_call_chars: int = DEFAULT_MAX_CALL_CHARS):
        for spec in tool_specs:
            tool_function(spec)
        self.max_call_chars = check_max_call_chars(max_call_chars)

    def parse(self, text: str, tool_names: Collection[str] | None = None) -> ParsedAction:
        """Read one action (see actions.py for the rule). `tool_names` is not used by this format."""
        return read_action(
            text, {TOOL_CALL_OPEN: TOOL_CALL_CLOSE}, TOOL_RESPONSE_OPEN, _read_call, self.max_call_chars
        )

    def format_calls(self, calls: Sequence[ParsedCall]) -> str:
        """Qwen2.5's layout ("<tool_call>\\n{json}\\n</tool_call>" per call, one per line).

        "</" is written as the JSON escape "<\\/", so an argument that holds "</tool_call>" cannot
        close the tag early; json.loads reads it back unchanged.
        """
        blocks = []
        for call in calls:
            try:
                body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
            except (TypeError, ValueError) as error:
                raise ValueError(f"call {call.name!r}: arguments are not JSON-serialisable ({error})") from None
            escaped = body.replace("</", "<\\/")
            blocks.append(f"{TOOL_CALL_OPEN}\n{escaped}\n{TOOL_CALL_CLOSE}")
        return "\n".join(blocks)

    def format_answer(self, answer: str) -> str:
        return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"

    def system_prompt(self, tool_specs: Sequence[Mapping[str, Any]]) -> str:
        """Qwen2.5's tools text (one spec as JSON per line, as its template's `tojson` writes it),
        then the answer instructions."""
        for spec in tool_specs:
            tool_function(spec)
        listing = "".join("\n" + json.dumps(spec, ensure_ascii=False) for spec in tool_specs)
        return f"{_TOOLS_HEADER}{listing}{_TOOLS_FOOTER}\n\n{self.answer_instructions}"

    def observation_messages(self, results: Sequence[tuple[str, str]], supports_tool_role: bool) -> list[ChatMessage]:
        """One "tool" message per result where the template has a tool role (it adds the
        `<tool_response>` wrapping itself); otherwise one user message with each result wrapped."""
        if not results:
            raise ValueError("observation_messages needs at least one (tool name, text) result")
        if supports_tool_role:
            return [ChatMessage("tool", text) for _, text in results]
        wrapped = (f"{TOOL_RESPONSE_OPEN}\n{text}\n{TOOL_RESPONSE_CLOSE}" for _, text in results)
        return [ChatMessage("user", "\n".join(wrapped))]


def _read_call(tag: str, body: str) -> ParsedCall | ActionError:
    try:
        decoded = json.loads(body)
    except (ValueError, RecursionError) as error:  # RecursionError: deeply nested brackets
        detail = error.msg if isinstance(error, json.JSONDecodeError) else type(error).__name__
        return ActionError("malformed_json", f"{tag} does not hold valid JSON ({detail})")
    if not isinstance(decoded, dict):
        return ActionError("malformed_json", f"{tag} holds a JSON {_json_type(decoded)}, not an object")
    name = decoded.get("name")
    if not isinstance(name, str) or not name.strip():
        return ActionError("missing_name", f'{tag} object has no "name" string (keys: {", ".join(map(str, decoded))})')
    raw_arguments = decoded.get("arguments", {})
    arguments = _arguments_object(raw_arguments)
    if arguments is None:
        is_text = isinstance(raw_arguments, str)
        what = "a string that does not hold a JSON object" if is_text else f"a {_json_type(raw_arguments)}"
        return ActionError("bad_arguments_type", f'call {name!r}: "arguments" is {what}, not a JSON object')
    return ParsedCall(name, arguments)


def _arguments_object(arguments: Any) -> dict | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    return arguments if isinstance(arguments, dict) else None


def _json_type(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
