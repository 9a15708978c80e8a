"""The environment contract of the extended MDP (docs/architecture.md §2).

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
    """One call an action made, and how it went (stored in the steps table's tool_calls JSON).

    error_kind: None, or unknown_tool / bad_arguments / exception / timeout / unavailable /
    over_budget (agent_core.envs.tools.ERROR_KINDS)."""

    name: str
    arguments: dict[str, Any]
    ok: bool = True
    error_kind: str | None = None
    latency_s: float = 0.0


@dataclass(frozen=True)
class EnvStep:
    """The env's answer to one action.

    observation: text of the next turn shown to the model ("" when done).
    observation_messages: the observation as chat messages, when it is not one message of the env's
        observation_role (e.g. one "tool" message per call result); `observation` is then their text.
    reward: the process reward of this step (the outcome reward is labelled later, by a scorer).
    done: the episode ended with this step; termination then says why (one of TERMINATIONS).
    tool_calls: what the action asked for, as parsed. parse_error: why the action could not be
    parsed, if it could not (bad actions are data, not crashes).
    info: anything else worth keeping; stored as JSON in the steps table.
    anchor: a key of the state this action led to (None: the env gives none), for GiGPO's anchor
        groups (agent_core/algos/gigpo.py): equal keys within a prompt's group mean the same state,
        so make it a normalised observation (e.g. the retrieved document ids), not raw text with
        incidental differences. The agent loop stores it on the NEXT step, the one that starts there.
    """

    observation: str
    reward: float
    done: bool
    termination: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    parse_error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    observation_messages: tuple[ChatMessage, ...] = ()
    anchor: str | None = None


class AgentEnv(Protocol):
    """Any environment an agent can act in. One instance runs one episode at a time."""

    observation_role: str  # chat role the observation is rendered as ("user" or "tool")
    # Optional: `tools_for_template: list[dict] | None`, tool specs the chat template renders
    # itself (passed as `tools=`); envs without it (or None) describe their tools in the prompt.

    def reset(self, prompt: Prompt) -> tuple[ChatMessage, ...]:
        """Start an episode for `prompt`; return the opening conversation (system + user)."""
        ...

    def step(self, action_text: str) -> EnvStep:
        """Apply one action (decoded policy output) and return the env's answer."""
        ...
