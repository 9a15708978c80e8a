"""The environment contract of the extended MDP (DESIGN.md §2).

An env sees text: it opens an episode with a conversation and answers each action (the decoded
text of the policy's tokens) with an observation. Tokenization, context management and budgets
(max steps, context length) belong to the agent loop, so every env gets them for free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from agent_core.types import ChatMessage, Prompt

TERMINATIONS = ("answered", "max_steps", "max_context", "error")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class EnvStep:
    """The env's answer to one action.

    observation: text of the next turn shown to the model ("" when done).
    reward: the process reward of this step (the outcome reward is labelled later, by a scorer).
    done: the episode ended with this step; termination then says why (one of TERMINATIONS).
    tool_calls: what the action asked for, as parsed. parse_error: why the action could not be
    parsed, if it could not (bad actions are data, not crashes).
    info: anything else worth keeping; stored as JSON in the steps table.
    """

    observation: str
    reward: float
    done: bool
    termination: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    parse_error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


class AgentEnv(Protocol):
    """Any environment an agent can act in. One instance runs one episode at a time."""

    observation_role: str  # chat role the observation is rendered as ("user" or "tool")

    def reset(self, prompt: Prompt) -> tuple[ChatMessage, ...]:
        """Start an episode for `prompt`; return the opening conversation (system + user)."""
        ...

    def step(self, action_text: str) -> EnvStep:
        """Apply one action (decoded policy output) and return the env's answer."""
        ...
