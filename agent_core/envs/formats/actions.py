"""What a tool-call format reads out of an action, and the reading rule every format shares.

An action (the decoded text of the policy's tokens) holds tool calls, a final answer, or neither. Formats
differ only in how a call is written (hermes: JSON inside `<tool_call>`; tag: a tag named after the tool); the
order rule is shared and follows Search-R1's reading order: the action is read as written, and reading stops
at the format's result tag. Only the policy's action text is ever parsed, never observations.
Design notes: docs/architecture.md §11 (agent_core/envs/formats/actions.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Protocol, Sequence, runtime_checkable

from agent_core.registry import Registry
from agent_core.types import ChatMessage

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
DEFAULT_MAX_CALL_CHARS = 4096

# Every kind of ActionError, with what it means (the message says which call and why).
ACTION_ERROR_KINDS: dict[str, str] = {
    "malformed_json": "a hermes call's body is not JSON, or is JSON but not an object",
    "missing_name": "a hermes call's object has no non-empty string 'name'",
    "bad_arguments_type": "a hermes call's 'arguments' is neither an object nor a string holding one",
    "empty_call": "a call tag holds nothing but whitespace",
    "call_too_long": "a call's body is longer than the format's max_call_chars",
    "unclosed_tag": "a call or answer tag is opened and never closed",
    "no_action": "the text holds no call and no answer (or only after an imagined tool result)",
    "empty_answer": "the answer block that ends the episode holds nothing but whitespace",
}


@dataclass(frozen=True)
class ParsedCall:
    """One tool call as written. `arguments` is as parsed (a dict for well-formed hermes and tag
    calls); checking it against the tool's schema is the env's job."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class ActionError:
    """Why (part of) an action could not be read. kind: one of ACTION_ERROR_KINDS; message: short,
    names the offending call, and may be shown to the model."""

    kind: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in ACTION_ERROR_KINDS:
            raise ValueError(f"unknown action error kind {self.kind!r}; valid kinds: {', '.join(ACTION_ERROR_KINDS)}")


@dataclass(frozen=True)
class ParsedAction:
    """Everything read from one action: the calls to run (in order written), or the final answer.

    answer is not None only for an action that ends the episode; it then has no calls and no errors.
    An action with neither calls nor an answer always has at least one error saying why.
    """

    calls: tuple[ParsedCall, ...]
    answer: str | None
    errors: tuple[ActionError, ...]

    def __post_init__(self) -> None:
        if self.answer is not None and (self.calls or self.errors):
            raise ValueError("a ParsedAction with an answer has no calls and no errors")
        if self.answer is None and not self.calls and not self.errors:
            raise ValueError("a ParsedAction with no calls and no answer must say why in errors")


@runtime_checkable
class ToolCallFormat(Protocol):
    """How calls, answers and tool results are written in the conversation."""

    name: str
    max_call_chars: int
    answer_instructions: str  # how to give the final answer; also part of system_prompt

    def parse(self, text: str, tool_names: Collection[str] | None = None) -> ParsedAction:
        """Read one action. Never raises, whatever `text` is."""
        ...

    def format_calls(self, calls: Sequence[ParsedCall]) -> str:
        """The action text that makes these calls (for scripted episodes and tests)."""
        ...

    def format_answer(self, answer: str) -> str:
        """The action text that gives `answer` as the final answer."""
        ...

    def system_prompt(self, tool_specs: Sequence[Mapping[str, Any]]) -> str:
        """Instructions and tool list, for chat templates that do not take `tools=`."""
        ...

    def observation_messages(self, results: Sequence[tuple[str, str]], supports_tool_role: bool) -> list[ChatMessage]:
        """The messages that show (tool name, result text) pairs, in call order, to the model."""
        ...


FORMATS: Registry[Callable[..., ToolCallFormat]] = Registry("tool-call format")


def build_format(name: str, tool_specs: Sequence[Mapping[str, Any]] = (), **options: Any) -> ToolCallFormat:
    """The format registered as `name`, set up for `tool_specs` (UnknownNameError lists the names)."""
    return FORMATS.get(name)(tool_specs, **options)


# ---- tool specs (OpenAI function-calling dicts, what apply_chat_template(tools=) takes) ------------


def tool_function(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function part of a tool spec: {"type": "function", "function": {...}} or the bare {...}."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"a tool spec must be a dict, got {type(spec).__name__}: {spec!r}")
    function = spec.get("function", spec)
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool spec {spec!r} has no function name (expected {{'function': {{'name': ...}}}})")
    return function


def tool_name(spec: Mapping[str, Any]) -> str:
    return tool_function(spec)["name"]


def check_max_call_chars(max_call_chars: int) -> int:
    if not isinstance(max_call_chars, int) or max_call_chars < 1:
        raise ValueError(f"max_call_chars must be a positive int, got {max_call_chars!r}")
    return max_call_chars


# ---- the shared reading rule ------------------------------------------------------------------

# Reads one call's body (already known to be non-empty and short enough) as a call or an error.
CallReader = Callable[[str, str], "ParsedCall | ActionError"]  # (opening tag, body)


def read_action(
    text: str,
    call_tags: Mapping[str, str],
    result_tag: str,
    read_call: CallReader,
    max_call_chars: int,
) -> ParsedAction:
    """Apply the module's reading rule. call_tags: opening tag -> closing tag of each call kind."""
    if not isinstance(text, str):
        return _failed("no_action", f"the action is {type(text).__name__}, not text")
    tags = re.compile("|".join(re.escape(tag) for tag in {*call_tags, ANSWER_OPEN, result_tag}))
    calls: list[ParsedCall] = []
    errors: list[ActionError] = []
    unclosed_answer, stopped_at_result, position = False, False, 0
    while (found := tags.search(text, position)) is not None:
        tag = found.group()
        if tag == result_tag:
            stopped_at_result = True
            break
        if tag == ANSWER_OPEN:
            if calls or errors:
                break
            end = text.find(ANSWER_CLOSE, found.end())
            if end < 0:
                unclosed_answer, position = True, found.end()
                continue
            answer = text[found.end() : end].strip()
            if not answer:
                return _failed("empty_answer", f"{ANSWER_OPEN}{ANSWER_CLOSE} holds no answer")
            return ParsedAction((), answer, ())
        close = call_tags[tag]
        end = text.find(close, found.end())
        if end < 0:
            errors.append(ActionError("unclosed_tag", f"{tag} is never closed with {close}"))
            break
        errors_or_call = _read_body(tag, text[found.end() : end], read_call, max_call_chars)
        (errors if isinstance(errors_or_call, ActionError) else calls).append(errors_or_call)
        position = end + len(close)
    if not calls and not errors:
        if unclosed_answer:
            errors.append(ActionError("unclosed_tag", f"{ANSWER_OPEN} is never closed with {ANSWER_CLOSE}"))
        else:
            where = f" before {result_tag}" if stopped_at_result else ""
            errors.append(ActionError("no_action", f"no tool call and no {ANSWER_OPEN}{where}"))
    return ParsedAction(tuple(calls), None, tuple(errors))


def _read_body(tag: str, body: str, read_call: CallReader, max_call_chars: int) -> ParsedCall | ActionError:
    if not body.strip():
        return ActionError("empty_call", f"{tag} holds nothing")
    if len(body) > max_call_chars:
        return ActionError("call_too_long", f"{tag} holds {len(body)} characters; the limit is {max_call_chars}")
    return read_call(tag, body)


def _failed(kind: str, message: str) -> ParsedAction:
    return ParsedAction((), None, (ActionError(kind, message),))
