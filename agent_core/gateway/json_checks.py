"""What JSON the gateway takes in and hands out: text that is valid Unicode (JSON lets a body carry a
lone surrogate, `"\\ud800"`, which no tokenizer takes), nesting no deeper than MAX_JSON_DEPTH (deeper
would overflow the stack later, in json.dumps or the chat template, on whatever thread meets it), and
no NaN or Infinity (not JSON; Python's json reads and writes them, a client's parser need not). Each
check returns the one-line problem, or None; openai_format.py raises it as a RequestError.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 100  # nesting levels; a tool's schema needs ~2 per level of its own nesting


def body_problem(body: Any) -> str | None:
    """Why decoded JSON `body` is refused: too deep, or a lone surrogate (naming where); None if neither."""
    problem = depth_problem(body, "the body")
    if problem is not None:
        return problem
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # at C speed; fails only at a lone surrogate
    except UnicodeEncodeError:
        return _surrogate_problem(body)
    return None


def depth_problem(value: Any, where: str) -> str | None:
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"{where}: nested deeper than {MAX_JSON_DEPTH} levels"
        stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value)
                     if isinstance(item, (dict, list)))
    return None


def arguments_problem(raw: Any, where: str) -> str | None:
    """Why a call's arguments string (parsed again when the conversation is rendered) is refused: nested
    too deep to read back. Text that is not JSON is kept as the policy wrote it."""
    if not isinstance(raw, str):
        return None
    try:
        return depth_problem(json.loads(raw), where)
    except RecursionError:
        return f"{where}: nested deeper than {MAX_JSON_DEPTH} levels"
    except ValueError:
        return None


def is_plain_json(value: Any) -> bool:
    """Whether `value` can be written as JSON for any client: no NaN or Infinity, not too deep."""
    if depth_problem(value, "") is not None:
        return False
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def printable(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _surrogate_problem(body: Any) -> str | None:
    """The first string of `body`, keys included, that holds a lone surrogate, named."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        texts: list[tuple[str, str]] = []
        if isinstance(value, dict):
            texts = [(key, f"a key of {where or 'the body'}") for key in value]
            stack.extend((f"{where}.{printable(key)}" if where else printable(key), item)
                         for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{where}[{index}]", item) for index, item in reversed(list(enumerate(value))))
        elif isinstance(value, str):
            texts = [(value, where)]
        for text, place in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:  # a Python str fails to encode only at a surrogate
                return (f"{place} holds a lone surrogate (\\u{ord(text[error.start]):04x} at character "
                        f"{error.start}): text must be valid Unicode")
    return None
