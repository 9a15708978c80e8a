"""Anthropic's Messages API (`POST /v1/messages`) over the same episode recording: a request becomes
the chat-completions request it means, the served completion becomes a `message` object.

`system` becomes the system message; `tool_use` blocks become the assistant's tool calls and
`tool_result` blocks the tool messages; `tool_choice` any / tool / none and `disable_parallel_tool_use`
map to OpenAI's required / a named function / none and `parallel_tool_calls: false`. A streamed
request gets the message's events (generated whole first). Images, documents, thinking and `top_k`
are refused with a 400 naming them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Mapping

from agent_core.gateway.openai_format import (
    ChatRequest, Completion, RequestError, check_fields, listed, parse_request,
)

_ACCEPTED = {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "temperature", "top_p",
             "stop_sequences", "stream", "metadata", "service_tier", "top_k", "thinking"}


def chat_request(body: Any) -> ChatRequest:
    """The chat-completions request a Messages `body` means, or RequestError naming the bad field."""
    body = check_fields(body, _ACCEPTED, "'s Messages API")
    for key in ("top_k", "thinking"):
        if body.get(key) not in (None, False) and body[key] != {"type": "disabled"}:
            raise RequestError(f"{key} is not supported on /v1/messages by this gateway")
    if isinstance(body.get("max_tokens"), bool) or not isinstance(body.get("max_tokens"), int):
        raise RequestError("max_tokens is required: an int >= 1")
    messages = _system(body.get("system"))
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError("messages must be a non-empty list")
    for index, message in enumerate(body["messages"]):
        messages += _converted(message, index)
    choice, parallel = _tool_choice(body.get("tool_choice"))
    chat = {"model": body.get("model", ""), "messages": messages, "tools": [_tool(t) for t in listed(body, "tools")],
            "tool_choice": choice, "parallel_tool_calls": parallel, "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_tokens": body["max_tokens"], "stop": body.get("stop_sequences"),
            "user": body["metadata"].get("user_id") if isinstance(body.get("metadata"), dict) else None,
            "stream": body.get("stream")}
    return parse_request({k: v for k, v in chat.items() if v is not None})


def _system(system: Any) -> list[dict]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in system):
        return [{"role": "system", "content": "".join(str(b.get("text", "")) for b in system)}]
    raise RequestError("system must be a string or a list of text blocks")


def _converted(message: Any, index: int) -> list[dict]:
    """One Messages-API message as OpenAI messages: a user turn's tool_result blocks are tool messages."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise RequestError(f"messages[{index}] must be an object with role user or assistant")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"messages[{index}].content must be a string or a list of blocks")
    texts, calls, results = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message["role"] == "assistant" and isinstance(block.get("name"), str):
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and message["role"] == "user":
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _result_text(block.get("content"), index),
                            **({"is_error": True} if block.get("is_error") else {})})
        else:
            raise RequestError(f"messages[{index}]: a {kind!r} block is not supported in a {message['role']} turn "
                               "(text, tool_use from the assistant, tool_result from the user)")
    if message["role"] == "assistant":
        return [{"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _result_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise RequestError(f"messages[{index}]: a tool_result's content must be a string or text blocks")


def _tool(tool: Any) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
        raise RequestError("tools: only client tools with name and input_schema are supported")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(OpenAI tool_choice, parallel_tool_calls) of a Messages-API tool_choice."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise RequestError("tool_choice must be an object of type auto, any, tool or none")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def message_body(completion: Completion, request: ChatRequest, model: str) -> dict[str, Any]:
    """A `message` object: the reply's text as a text block, each tool call a tool_use block."""
    content: list[dict] = [{"type": "text", "text": completion.content}] if completion.content else []
    for call in completion.tool_calls:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    if completion.tool_calls:
        reason = "tool_use"
    elif completion.finish_reason == "length":
        reason = "max_tokens"
    else:
        reason = "stop_sequence" if completion.stop_sequence else "end_turn"
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": completion.stop_sequence,
            "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": completion.completion_tokens}}


def message_events(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed `message` (as `message_body` made it), as the Anthropic client reads them."""
    events: list[dict[str, Any]] = [{"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 0}}}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        events += [{"type": "content_block_start", "index": index, "content_block": start},
                   {"type": "content_block_delta", "index": index, "delta": delta},
                   {"type": "content_block_stop", "index": index}]
    return [*events, {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                         "stop_sequence": message["stop_sequence"]},
                      "usage": {"output_tokens": message["usage"]["output_tokens"]}},
            {"type": "message_stop"}]
