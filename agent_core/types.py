"""Typed containers shared across agent_core: problems ("prompts") and retrieval documents."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Prompt:
    """One RL problem: the opening conversation, what counts as a right answer, and its env.

    Stored as one row of the `prompts` table (messages / ground_truth / env as JSON columns).
    """

    prompt_id: str
    data_source: str
    split: str  # "train" | "dev" | "test"
    messages: tuple[ChatMessage, ...]
    answers: tuple[str, ...]  # the gold answer first, then aliases
    env_name: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. hops, question type


@dataclass(frozen=True)
class Document:
    """One retrievable passage of a corpus (the `corpus` table)."""

    doc_id: str
    title: str
    text: str
