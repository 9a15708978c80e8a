"""Tool-call formats by name: how an agent's action writes tool calls and its final answer, and how
tool results are shown back to it.

- "hermes" (hermes.py): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results in
  `<tool_response>` (the Qwen2.5 / Hermes convention).
- "tag" (tag.py): `<search>query</search>` for tools with one text input, results in
  `<information>` (the Search-R1 convention).

Both end the episode with `<answer>text</answer>` and share the reading rule in actions.py.
Rendering these messages through a model's chat template is agent_core/rollout/chat.py's job.
"""

from agent_core.envs.formats.actions import (
    ACTION_ERROR_KINDS,
    ANSWER_CLOSE,
    ANSWER_OPEN,
    DEFAULT_MAX_CALL_CHARS,
    FORMATS,
    ActionError,
    ParsedAction,
    ParsedCall,
    ToolCallFormat,
    build_format,
    tool_function,
    tool_name,
)
from agent_core.envs.formats.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN
from agent_core.envs.formats.hermes import HermesFormat
from agent_core.envs.formats.tag import TagFormat, TagTool, tag_tool

__all__ = [
    "ACTION_ERROR_KINDS",
    "ANSWER_CLOSE",
    "ANSWER_OPEN",
    "DEFAULT_MAX_CALL_CHARS",
    "FORMATS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_RESPONSE_CLOSE",
    "TOOL_RESPONSE_OPEN",
    "ActionError",
    "HermesFormat",
    "ParsedAction",
    "ParsedCall",
    "TagFormat",
    "TagTool",
    "ToolCallFormat",
    "build_format",
    "tag_tool",
    "tool_function",
    "tool_name",
]
