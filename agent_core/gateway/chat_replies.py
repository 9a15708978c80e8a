"""Chat completions' replies: a served `Completion` as OpenAI's chat.completion object, or as the
chat.completion.chunk objects of a streamed request (the Responses and Messages APIs' replies are
in responses_format.py and messages_format.py)."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from agent_core.gateway.openai_format import Completion


def completion_body(completion: Completion, model: str, logprobs: bool = False) -> dict[str, Any]:
    """An OpenAI chat.completion object with one choice."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": completion.content or (None if completion.tool_calls else "")}
    if completion.tool_calls:
        message["tool_calls"] = list(completion.tool_calls)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [{"index": 0, "message": message, "finish_reason": _reason(completion),
                                     "logprobs": _logprobs(completion) if logprobs else None}],
        "usage": _usage(completion),
    }


def completion_chunks(completion: Completion, model: str, include_usage: bool = False,
                      logprobs: bool = False) -> list[dict[str, Any]]:
    """The same reply as chat.completion.chunk objects, for a streamed request: the role, the text, each
    tool call whole, the finish reason, and the usage when asked (stream_options.include_usage). The
    reply is generated before it is sent, so the chunks arrive together."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict, finish: str | None = None, with_logprobs: bool = False) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish,
                  "logprobs": _logprobs(completion) if with_logprobs else None}
        return {**base, "choices": [choice]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if completion.content:
        chunks.append(chunk({"content": completion.content}, with_logprobs=logprobs))
    for index, call in enumerate(completion.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]},
                            with_logprobs=logprobs and not completion.content and index == 0))
    chunks.append(chunk({}, _reason(completion)))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": _usage(completion)})
    return chunks


def _reason(completion: Completion) -> str:
    return "tool_calls" if completion.tool_calls else completion.finish_reason


def _usage(completion: Completion) -> dict[str, int]:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}


def _finite(logprob: float) -> float:
    """A log-prob JSON can carry: -inf (or NaN) is OpenAI's own floor, -9999.0."""
    return logprob if math.isfinite(logprob) else -9999.0


def _logprobs(completion: Completion) -> dict[str, Any]:
    """OpenAI's logprobs object: each generated token's text and log-prob (no alternatives)."""
    return {"content": [{"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8")),
                         "top_logprobs": []}
                        for token, logprob in zip(completion.tokens, completion.logprobs)], "refusal": None}
