"""The tag action format: `<search>query</search>`, `<answer>text</answer>`, `<information>...`.

This is the Search-R1 / early Agent-R1 convention for small models that have no tool-calling chat
template: the policy writes XML-like tags in plain text and the env answers a search with an
`<information>` block.

Which tag wins when an action holds several (the brief's rule, stricter than Search-R1's regex,
which takes whichever complete block starts first): the first complete `<answer>` block ends the
episode only if it starts before every `<search>` opening tag; otherwise the first complete
`<search>` block is the action. So "<search>q <answer>x</answer>" is an unclosed search (invalid),
not an answer: an action is read in the order it was written. Text after the winning block is
ignored (small models often hallucinate an `<information>` block after their query).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFORMATION_OPEN, INFORMATION_CLOSE = "<information>", "</information>"
ACTION_KINDS = ("search", "answer", "invalid")

FORMAT_HINT = "Write <search>query</search> to search or <answer>text</answer> to answer."


@dataclass(frozen=True)
class ParsedAction:
    """One action read from the policy's text.

    kind: "search" | "answer" | "invalid".
    content: the stripped query or answer text ("" when invalid).
    error: why the action is invalid (None otherwise); short, it is shown to the model.
    """

    kind: str
    content: str
    error: str | None = None


@dataclass(frozen=True)
class _Block:
    start: int  # index of the opening tag
    content: str


def _first_complete_block(text: str, open_tag: str, close_tag: str) -> _Block | None:
    """The first `open_tag` that has a `close_tag` after it, and the text between them."""
    start = text.find(open_tag)
    if start < 0:
        return None
    body_start = start + len(open_tag)
    end = text.find(close_tag, body_start)
    if end < 0:
        # A later opening tag cannot have a close either: there is no close after this one.
        return None
    return _Block(start=start, content=text[body_start:end])


def _invalid(error: str) -> ParsedAction:
    return ParsedAction(kind="invalid", content="", error=error)


def parse_action(text: str) -> ParsedAction:
    """Read one action from `text`; never raises (bad actions are data, not crashes)."""
    if not isinstance(text, str):
        return _invalid(f"action is {type(text).__name__}, not text")
    first_search_tag = text.find(SEARCH_OPEN)
    answer = _first_complete_block(text, ANSWER_OPEN, ANSWER_CLOSE)
    if answer is not None and (first_search_tag < 0 or answer.start < first_search_tag):
        content = answer.content.strip()
        return ParsedAction("answer", content) if content else _invalid("empty answer")
    search = _first_complete_block(text, SEARCH_OPEN, SEARCH_CLOSE)
    if search is not None:
        content = search.content.strip()
        return ParsedAction("search", content) if content else _invalid("empty search query")
    if first_search_tag >= 0:
        return _invalid("unclosed <search> tag")
    if ANSWER_OPEN in text:
        return _invalid("unclosed <answer> tag")
    return _invalid("no <search> or <answer> tag")


def format_search(query: str) -> str:
    """The action text that searches for `query` (for scripted episodes and tests)."""
    return f"{SEARCH_OPEN}{query}{SEARCH_CLOSE}"


def format_answer(answer: str) -> str:
    """The action text that gives `answer` as the final answer."""
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def format_information(passages: Sequence[str]) -> str:
    """The env's answer to a search: one passage per line inside an `<information>` block."""
    body = "\n".join(passages) if passages else "no results"
    return f"{INFORMATION_OPEN}{body}{INFORMATION_CLOSE}"
