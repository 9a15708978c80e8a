"""OpenAI's Responses API (`POST /v1/responses`, what the OpenAI Agents SDK calls) over the same
episode recording: a request becomes the chat-completions request it means, the served completion
becomes a `response` object.

Input items: messages (string or text parts), `function_call` and `function_call_output`; the
`instructions` become the system message. A streamed request gets the response's events (generated
whole first, so they arrive together). Server-side state (`previous_response_id`), hosted tools and
reasoning items are refused with a 400 naming them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Mapping

from agent_core.gateway.openai_format import (
    ChatRequest, Completion, RequestError, check_fields, listed, parse_request,
)

# fields a Responses request may carry; any other is refused by name
_ACCEPTED = {"model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "temperature", "top_p", "max_output_tokens",
             "parallel_tool_calls", "store", "metadata", "user", "truncation", "include", "service_tier", "text",
             "stream", "reasoning", "prompt_cache_key", "safety_identifier"}


def chat_request(body: Any) -> ChatRequest:
    """The chat-completions request a Responses `body` means, or RequestError naming the bad field."""
    body = check_fields(body, _ACCEPTED, "'s Responses API")
    if body.get("previous_response_id"):
        raise RequestError("previous_response_id is not supported: send the whole conversation as input")
    if body.get("reasoning"):
        raise RequestError("reasoning is not supported by this gateway")
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    text_format = text.get("format").get("type") if isinstance(text.get("format"), dict) else "text"
    if text_format != "text":
        raise RequestError(f"text.format {text_format!r} is not supported: plain text only")
    messages = _messages(body.get("input"), body.get("instructions"))
    chat = {"model": body.get("model", ""), "messages": messages, "tools": [_tool(t) for t in listed(body, "tools")],
            "tool_choice": _tool_choice(body.get("tool_choice", "auto")), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_tokens": body.get("max_output_tokens")}
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    for key in ("user", "metadata"):  # an agent's name (openai_format.agent_name)
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    return parse_request({k: v for k, v in chat.items() if v is not None})


def _messages(items: Any, instructions: Any) -> list[dict]:
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string")
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty list of items")
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"input[{index}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            _add_message(messages, item, index)
        elif kind == "function_call":
            _add_call(messages, item, index)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise RequestError(f"input[{index}]: a function_call_output needs call_id and a string output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(output, index)})
        else:
            raise RequestError(f"input[{index}]: items of type {kind!r} are not supported (message, function_call, "
                               "function_call_output)")
    return messages


def _add_message(messages: list[dict], item: Mapping[str, Any], index: int) -> None:
    role = item.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise RequestError(f"input[{index}].role must be system, developer, user or assistant")
    messages.append({"role": role, "content": _text(item.get("content"), index)})


def _add_call(messages: list[dict], item: Mapping[str, Any], index: int) -> None:
    """A function_call joins the assistant message before it (one turn: its text, then its calls)."""
    if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
        raise RequestError(f"input[{index}]: a function_call needs call_id, name and arguments (a JSON string)")
    call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"input[{index}].content must be a string or a list of text parts (input_text, output_text)")


def _tool(tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise RequestError(f"tools: only function tools are supported, got {kind!r}")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_body(completion: Completion, request: ChatRequest, model: str) -> dict[str, Any]:
    """A `response` object: the reply's text as a message item, each tool call a function_call item."""
    output: list[dict] = []
    if completion.content:
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": completion.content, "annotations": []}]})
    for call in completion.tool_calls:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    cut = completion.finish_reason == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "output": output, "parallel_tool_calls": request.parallel_tool_calls,
        "tool_choice": _reply_tool_choice(request.tool_choice),
        "tools": [{"type": "function", "name": t["function"]["name"], "parameters": t["function"].get("parameters"),
                   "description": t["function"].get("description"), "strict": False} for t in request.tools],
        "temperature": request.temperature, "top_p": request.top_p, "max_output_tokens": request.max_tokens,
        "instructions": None, "metadata": {},
        "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": completion.completion_tokens,
                  "total_tokens": completion.prompt_tokens + completion.completion_tokens,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    }


def _reply_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice


def response_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed `response` (as `response_body` made it), in the order the OpenAI client
    assembles them: created, then per output item its added / delta / done events, then completed."""
    events: list[dict[str, Any]] = [{"type": "response.created",
                                     "response": {**response, "status": "in_progress", "output": []}}]
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "status": "in_progress", "content": []}},
                       {"type": "response.content_part.added", **at, "content_index": 0, "part": part},
                       {"type": "response.output_text.delta", **at, "content_index": 0, "delta": text, "logprobs": []},
                       {"type": "response.output_text.done", **at, "content_index": 0, "text": text, "logprobs": []},
                       {"type": "response.content_part.done", **at, "content_index": 0, "part": {**part, "text": text}}]
        else:
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "status": "in_progress", "arguments": ""}},
                       {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                       {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed" if response["status"] == "completed" else "response.incomplete",
                   "response": response})
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]
