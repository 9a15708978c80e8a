"""OpenAI chat-completions requests in, typed; the policy's chat messages out; OpenAI responses back.

A field the gateway does not serve is refused by name, never ignored; so is any string that is not valid
Unicode, JSON nested deeper than MAX_JSON_DEPTH (body or a call's arguments: json_checks.py) and a
tool_call_id that is not a string: a `RequestError` (HTTP 400). A generated call whose arguments hold NaN
or Infinity is not a call (JSON has neither). A streamed request gets the same completion as server-sent
events. A conversation becomes the chat messages our `tool_env` gives with the hermes format (tools,
`<tool_call>` blocks, `<tool_response>` turns), so a policy trained in either sees one convention.
Design notes: docs/architecture.md §11 (agent_core/gateway/openai_format.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from agent_core.envs.formats.actions import ActionError, ParsedAction, ParsedCall
from agent_core.envs.formats.hermes import TOOL_CALL_OPEN, HermesFormat
from agent_core.envs.tool_env import ChatCapabilities, add_instructions
from agent_core.gateway.json_checks import MAX_JSON_DEPTH, arguments_problem, body_problem, is_plain_json, printable
from agent_core.types import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4  # as OpenAI's API
_HERMES = HermesFormat()
_AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # never ".", ".." or "-": it names files and episodes


class RequestError(ValueError):
    """A request the gateway refuses (HTTP 400); the message is one line."""


# Every field a request may carry. Those in _NEUTRAL only with a value that changes nothing; the rest are
# served (sampling fields the run's settings override are recorded: core.GatewayCore._params).
_ACCEPTED = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
             "stop", "n", "stream", "stream_options", "parallel_tool_calls", "logprobs", "top_logprobs", "seed", "user",
             "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "frequency_penalty",
             "presence_penalty", "logit_bias", "response_format", "modalities", "reasoning_effort"}
_NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "top_logprobs": (0,),
            "response_format": ({"type": "text"},), "modalities": (["text"],), "reasoning_effort": ()}


@dataclass(frozen=True)
class ChatRequest:
    """What the gateway reads from one chat-completions request (the Responses and Messages APIs'
    requests are turned into one: responses_format.py, messages_format.py)."""

    model: str
    messages: tuple[Mapping[str, Any], ...]  # as sent (OpenAI shape), checked
    tools: tuple[Mapping[str, Any], ...]
    tool_choice: Any  # auto | none | required | {"type": "function", "function": {"name": ...}}, checked
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    parallel_tool_calls: bool = True  # False: the reply ends after its first tool call
    logprobs: bool = False  # return each generated token's log-prob (the sampling distribution's)
    seed: int | None = None  # recorded; the run's seeding decides (core.GatewayCore._params)
    agent: str | None = None  # which of the program's agents asks (header X-AgentR1-Agent, `user`, metadata.agent)


@dataclass(frozen=True)
class Completion:
    """One served reply, whatever API asked for it: its text, OpenAI-shaped tool calls and counts."""

    content: str
    tool_calls: tuple[dict, ...]
    finish_reason: str  # stop | length (the reply's is tool_calls when it has calls)
    prompt_tokens: int
    completion_tokens: int
    tokens: tuple[str, ...] = ()  # each generated token's text, with `logprobs`, when the request asked
    logprobs: tuple[float, ...] = ()
    stop_sequence: str | None = None  # the stop string that ended it, if one did


def parse_request(body: Any) -> ChatRequest:
    """The request in `body` (decoded JSON), or RequestError naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_json(body)
    _check_served(body)
    if body.get("n", 1) != 1:
        raise RequestError(f"n={body.get('n')!r} is not supported: one choice per request (n=1)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    for index, message in enumerate(messages):
        _check_message(message, index)
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(_is_function_tool(tool) for tool in tools):
        raise RequestError('tools must be a list of {"type": "function", "function": {"name": ...}} objects')
    tool_choice = _tool_choice(body.get("tool_choice", "auto"), tools)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    return ChatRequest(
        model=str(body.get("model", "")), messages=tuple(messages), tools=tuple(tools), tool_choice=tool_choice,
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0),
        max_tokens=max_tokens, stop=tuple(stop), stream=_flag(body, "stream", False),
        include_usage=_flag(body.get("stream_options") or {}, "include_usage", False),
        parallel_tool_calls=_flag(body, "parallel_tool_calls", True), logprobs=_flag(body, "logprobs", False),
        seed=_seed(body.get("seed")),
        agent=agent_name(body.get("user") or _metadata(body).get("agent")),
    )


def _metadata(body: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = body.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def agent_name(name: Any) -> str | None:
    """A program's name for one of its agents (a planner, a solver), checked; None when it gives none."""
    if name is None or name == "":
        return None
    if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name):
        raise RequestError(f"agent name {str(name)[:80]!r}: 1-64 letters, digits, '_', '.' or '-', "
                           "starting with a letter or digit")
    return name


def check_fields(body: Any, accepted: set[str], api: str = "") -> dict[str, Any]:
    """`body` if it is a JSON object of `accepted` fields only; else RequestError naming the others."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(key for key in body if key not in accepted)
    if unknown:
        raise RequestError(f"{', '.join(map(printable, unknown))}: not supported by this gateway{api}")
    return body


def listed(body: Mapping[str, Any], key: str) -> list:
    """`body[key]` when it is a list, [] when absent or null; else RequestError."""
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(f"{key} must be a list")
    return value


def check_json(body: Any) -> None:
    """RequestError when decoded JSON `body` is not what the gateway takes (json_checks.py)."""
    if (problem := body_problem(body)) is not None:
        raise RequestError(problem)


def _check_served(body: Mapping[str, Any]) -> None:
    """RequestError naming the fields this gateway does not serve (module docstring)."""
    check_fields(body, _ACCEPTED)
    for key, neutral in _NEUTRAL.items():
        if body.get(key) is not None and body[key] not in neutral:
            raise RequestError(f"{key}={json.dumps(body[key])[:80]} is not supported by this gateway")
    if body.get("stream_options") is not None and (not isinstance(body["stream_options"], dict)
                                                   or set(body["stream_options"]) - {"include_usage"}):
        raise RequestError("stream_options: only include_usage is supported")


def _tool_choice(choice: Any, tools: list) -> Any:
    """`choice` checked against the tools offered: a named function must be one of them."""
    names = [tool["function"]["name"] for tool in tools]
    if choice in ("auto", "none"):
        return choice
    if choice == "required":
        if not tools:
            raise RequestError("tool_choice=required needs tools")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise RequestError(f"tool_choice {choice!r} is not one of auto, none, required or "
                           '{"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools offered "
                           f"({', '.join(names) or 'none'})")
    return {"type": "function", "function": {"name": name}}


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {value!r}")
    return value


def _seed(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise RequestError(f"seed must be an integer, got {value!r}")
    return value


def forced_prefix(request: ChatRequest) -> str:
    """What the reply must start with for `tool_choice` (required: a call; a named function: a call of
    it), put at the end of the prompt so the policy writes the rest; "" otherwise."""
    if not request.tools or request.tool_choice in ("auto", "none"):
        return ""
    if request.tool_choice == "required":
        return TOOL_CALL_OPEN + "\n"
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(request.tool_choice["function"]["name"])}, "arguments": '


def one_call_only(request: ChatRequest) -> bool:
    """Whether the reply ends after its first tool call (parallel_tool_calls false, or a named function)."""
    return bool(request.tools) and (not request.parallel_tool_calls or isinstance(request.tool_choice, dict))


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{key} must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _is_function_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (isinstance(function, dict) and tool.get("type", "function") == "function"
            and isinstance(function.get("name"), str) and bool(function["name"]))


def _check_message(message: Any, index: int) -> None:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"messages[{index}] must be an object with a role in {', '.join(ROLES)}")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise RequestError(f"messages[{index}].content must be a string, a list of text parts or null")
    if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
        raise RequestError(f"messages[{index}].content: only text parts are supported")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not all(_is_call(call) for call in calls):
        raise RequestError(f"messages[{index}].tool_calls must be a list of function calls with name and arguments")
    for call in calls:
        problem = arguments_problem(call["function"].get("arguments"), f"messages[{index}]: a tool call's arguments")
        if problem is not None:
            raise RequestError(problem)
    if not isinstance(message.get("tool_call_id", ""), (str, type(None))):
        raise RequestError(f"messages[{index}].tool_call_id must be a string")


def _is_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _call_arguments(raw: Any) -> Any:
    """A call's arguments as the policy wrote them: OpenAI sends them as a JSON string."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return {} if raw is None else raw


def chat_messages(messages: Sequence[Mapping[str, Any]], chat: ChatCapabilities) -> list[ChatMessage]:
    """OpenAI `messages` as the policy's chat messages (module docstring); tools are `template_tools`'s."""
    converted: list[ChatMessage] = []
    for message in messages:
        role, content = message["role"], _text(message.get("content"))
        if role == "developer":
            role = "system"
        if role == "assistant" and message.get("tool_calls"):
            calls = [ParsedCall(c["function"]["name"], _call_arguments(c["function"].get("arguments")))
                     for c in message["tool_calls"]]
            blocks = _HERMES.format_calls(calls)
            content = f"{content}\n{blocks}" if content else blocks
        if role == "tool":
            converted.extend(_HERMES.observation_messages([("tool", content)], chat.tool_role))
        else:
            converted.append(ChatMessage(role, content))
    return converted


def conversation(request: ChatRequest, chat: ChatCapabilities) -> tuple[list[ChatMessage], list[dict] | None]:
    """(the whole conversation as chat messages, the tools for the template's `tools=` or None):
    tools the template cannot list go into the system message (module docstring)."""
    messages = chat_messages(request.messages, chat)
    tools = template_tools(request, chat)
    if request.tools and request.tool_choice != "none" and tools is None:
        listing = _HERMES.system_prompt(request.tools).removesuffix("\n\n" + _HERMES.answer_instructions)
        return list(add_instructions(messages, listing)), None
    return messages, tools


def template_tools(request: ChatRequest, chat: ChatCapabilities) -> list[dict] | None:
    """The tools to pass the chat template as `tools=`, None where it cannot list them or none are offered."""
    if not request.tools or request.tool_choice == "none" or not chat.tools_in_template:
        return None
    return [dict(tool) for tool in request.tools]


def same_assistant_turn(message: Mapping[str, Any], content: str, tool_calls: Sequence[Mapping[str, Any]]) -> bool:
    """Whether `message` (sent back by the agent) is the reply the gateway returned, unchanged."""
    if message.get("role") != "assistant" or _text(message.get("content")) != (content or ""):
        return False
    sent = [(c["function"]["name"], c["function"].get("arguments")) for c in message.get("tool_calls") or []]
    return sent == [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


def tool_outcomes(messages: Sequence[Mapping[str, Any]], reply_calls: Sequence[Mapping[str, Any]]) -> list[bool | None]:
    """Per tool call of a reply, whether the tool message answering it (by tool_call_id) reports
    success: False when it is flagged `is_error` (Anthropic's tool_result), is a JSON object with an
    `error`, or starts with "error"; None when no message answers it."""
    answers = {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
    outcomes: list[bool | None] = []
    for call in reply_calls:
        answer = answers.get(call.get("id"))
        outcomes.append(None if answer is None else not (answer.get("is_error") or _reads_as_error(
            _text(answer.get("content")))))
    return outcomes


def _reads_as_error(text: str) -> bool:
    text = text.strip()
    if text.lower().startswith("error"):
        return True
    try:
        decoded = json.loads(text)
    except ValueError:
        return False
    return isinstance(decoded, dict) and decoded.get("error") not in (None, "", False)


def parse_tool_calls(text: str, request: ChatRequest) -> tuple[str, list[dict], ParsedAction | None]:
    """(content, OpenAI tool_calls, the parse) of generated `text`: hermes calls when the request
    offered tools, the whole text as content otherwise. Content is the text before the first call."""
    if not request.tools or request.tool_choice == "none":
        return text, [], None
    action = _writable_calls(_HERMES.parse(text))
    if not action.calls:
        return text, [], action
    content = text.split("<tool_call>", 1)[0].strip()
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
             for call in action.calls]
    return content, calls, action


def _writable_calls(action: ParsedAction) -> ParsedAction:
    """`action` less the calls whose arguments no API's reply could carry: NaN or Infinity (JSON has
    neither; Python's json reads and writes them, a client's parser need not) or nesting deeper than
    MAX_JSON_DEPTH. Such a call is malformed, as one that does not parse."""
    kept = tuple(call for call in action.calls if is_plain_json(call.arguments))
    if len(kept) == len(action.calls):
        return action
    error = ActionError("malformed_json", "a tool call's arguments hold NaN or Infinity, or nest deeper than "
                                          f"{MAX_JSON_DEPTH} levels")
    return ParsedAction(kept, None, (*action.errors, error))


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (the `openai` client raises it as APIStatusError with this message)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
