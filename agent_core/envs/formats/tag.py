"""The tag tool-call format: `<search>query</search>`, generalised to any tool with one text input.

The Search-R1 convention for models without a tool-calling template: the tag
is the tool's name and its content is the value of the tool's single required string parameter;
results come back in `<information>...</information>` blocks in a user message, and
`<answer>text</answer>` ends the episode. The tool specs are given at setup so the format knows
each tool's parameter; a tool that does not have exactly one required parameter, of type string,
cannot be written as a tag and is refused there (ValueError).

Where it differs from Search-R1: an action may hold several calls (read by the rule in
actions.py), one format serves any set of such tools, not only `search`, and an invalid action is
answered with an error observation instead of ending the episode.
"""

from __future__ import annotations

from dataclasses import dataclass
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

INFORMATION_OPEN, INFORMATION_CLOSE = "<information>", "</information>"
_RESERVED_NAMES = ("answer", "information")  # their tags already mean something in this format
ANSWER_INSTRUCTIONS = f"When you know the final answer, write {ANSWER_OPEN}your answer{ANSWER_CLOSE}."


@dataclass(frozen=True)
class TagTool:
    """A tool as the tag format writes it: `<name>value of parameter</name>`."""

    name: str
    parameter: str
    description: str

    @property
    def open_tag(self) -> str:
        return f"<{self.name}>"

    @property
    def close_tag(self) -> str:
        return f"</{self.name}>"


def tag_tool(spec: Mapping[str, Any]) -> TagTool:
    """The tag form of a tool spec; ValueError unless it has exactly one required string parameter."""
    function = tool_function(spec)
    name = function["name"]
    if any(char.isspace() or char in "<>/" for char in name) or name in _RESERVED_NAMES:
        raise ValueError(
            f"tool {name!r} cannot be written as a tag: a tag name has no whitespace or '<', '>', '/', "
            f"and is not one of {', '.join(_RESERVED_NAMES)}"
        )
    parameters = function.get("parameters") or {}
    required = list(parameters.get("required") or [])
    properties = parameters.get("properties") or {}
    if len(required) != 1 or (properties.get(required[0]) or {}).get("type") != "string":
        raise ValueError(
            f"tool {name!r} cannot be used with the tag format: it needs exactly one required parameter of type "
            f"string (the tag's content), but its required parameters are {required or 'none'} "
            f"with types {[(properties.get(p) or {}).get('type') for p in required]}"
        )
    return TagTool(name=name, parameter=required[0], description=str(function.get("description") or ""))


@FORMATS.register("tag")
class TagFormat:
    """Reads and writes tag calls for the tools in `tool_specs` (checked here, at setup)."""

    name = "tag"
    answer_instructions = ANSWER_INSTRUCTIONS

    def __init__(self, tool_specs: Sequence[Mapping[str, Any]] = (), *, max_call_chars: int = DEFAULT_MAX_CALL_CHARS):
        self.tools = {tool.name: tool for tool in map(tag_tool, tool_specs)}
        self.max_call_chars = check_max_call_chars(max_call_chars)

    def parse(self, text: str, tool_names: Collection[str] | None = None) -> ParsedAction:
        """Read one action (see actions.py for the rule).

        Only the tags of `tool_names` (default: every tool given at setup) are calls; a name with
        no spec given at setup is not recognised, since its parameter is unknown. Other tags are text.
        """
        names = self.tools if tool_names is None else [name for name in tool_names if name in self.tools]
        by_open_tag = {self.tools[name].open_tag: self.tools[name] for name in names}

        def read_call(tag: str, body: str) -> ParsedCall | ActionError:
            tool = by_open_tag[tag]
            return ParsedCall(tool.name, {tool.parameter: body.strip()})

        call_tags = {tag: tool.close_tag for tag, tool in by_open_tag.items()}
        return read_action(text, call_tags, INFORMATION_OPEN, read_call, self.max_call_chars)

    def format_calls(self, calls: Sequence[ParsedCall]) -> str:
        """One tag per call, one per line. The value is written as is (parse strips it)."""
        blocks = []
        for call in calls:
            tool = self.tools.get(call.name)
            if tool is None:
                raise ValueError(f"unknown tool {call.name!r}; this tag format knows: {', '.join(self.tools)}")
            value = call.arguments.get(tool.parameter) if isinstance(call.arguments, Mapping) else None
            if not isinstance(value, str) or set(call.arguments) != {tool.parameter}:
                raise ValueError(f"call {call.name!r}: arguments must be {{{tool.parameter!r}: str}}, got {call.arguments!r}")
            if tool.close_tag in value:
                raise ValueError(f"call {call.name!r}: the value holds {tool.close_tag}, which would end the tag early")
            blocks.append(f"{tool.open_tag}{value}{tool.close_tag}")
        return "\n".join(blocks)

    def format_answer(self, answer: str) -> str:
        return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"

    def system_prompt(self, tool_specs: Sequence[Mapping[str, Any]]) -> str:
        """A short description of each tool's tag, where results appear, and how to answer."""
        lines = ["You can use these tools by writing the tool's tag around its input:"]
        for tool in map(tag_tool, tool_specs):
            description = f": {tool.description}" if tool.description else ""
            lines.append(f"{tool.open_tag}{tool.parameter}{tool.close_tag}{description}")
        lines.append(f"Results come back inside {INFORMATION_OPEN}{INFORMATION_CLOSE}.")
        lines.append(self.answer_instructions)
        return "\n".join(lines)

    def observation_messages(self, results: Sequence[tuple[str, str]], supports_tool_role: bool) -> list[ChatMessage]:
        """One user message with an `<information>` block per result (the tool role is not used:
        models trained on the Search-R1 convention read results from the user turn)."""
        if not results:
            raise ValueError("observation_messages needs at least one (tool name, text) result")
        blocks = (f"{INFORMATION_OPEN}{text}{INFORMATION_CLOSE}" for _, text in results)
        return [ChatMessage("user", "\n".join(blocks))]
