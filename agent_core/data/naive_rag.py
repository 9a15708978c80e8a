"""The naive_rag prompt: the retrieved passages and the question in one user turn.

Shared by the `naive_rag` evaluation method (agent_core.eval.methods), which asks it, and the warm
start's RAG demonstrations (agent_core.data.oracle), which answer it, so a policy is trained on
exactly the prompt it is evaluated with; here because eval builds on data, not the other way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agent_core.types import ChatMessage, Document, Prompt

ANSWER_INSTRUCTION = "Answer with <answer>...</answer>."
_QUESTION_PREFIX = re.compile(r"^\s*question:\s*", re.IGNORECASE)


def question_text(prompt: Prompt) -> str:
    """The question: the last user message, without a leading "Question:" (naive_rag adds its own)."""
    users = [m.content for m in prompt.messages if m.role == "user"]
    if not users:
        raise ValueError(f"prompt {prompt.prompt_id!r} has no user message to take the question from")
    return _QUESTION_PREFIX.sub("", users[-1]).strip()


def naive_rag_messages(prompt: Prompt, passages: Sequence[Document]) -> tuple[ChatMessage, ...]:
    """The prompt's system message(s), then one user turn: passages, question, answer instruction."""
    listed = "\n".join(f"[{i}] {doc.title}: {doc.text}" for i, doc in enumerate(passages, start=1)) or "(none found)"
    user = f"Passages:\n{listed}\n\nQuestion: {question_text(prompt)}\n\n{ANSWER_INSTRUCTION}"
    return (*(m for m in prompt.messages if m.role == "system"), ChatMessage("user", user))
