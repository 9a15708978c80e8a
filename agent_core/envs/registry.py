"""Envs by name: a prompt's `env_name` + `env_kwargs` (plus shared resources) build its env.

A factory takes the rollout's shared, read-only resources (built once per rollout, e.g. the search
index) and the prompt's keyword arguments. `make_env` checks the keyword names against the factory
before calling it, so a bad key in a dataset or config names the env and the valid keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from agent_core.envs.base import AgentEnv
from agent_core.envs.search import Bm25Index
from agent_core.envs.tool_env import ChatCapabilities, ToolEnv
from agent_core.envs.tools import TOOLS, make_tool
from agent_core.registry import Registry


@dataclass(frozen=True)
class EnvResources:
    """What envs share across a rollout. search_index: the corpus, for envs and tools that search.
    chat: what the policy's chat template can render (decides where tools are described)."""

    search_index: Bm25Index | None = None
    chat: ChatCapabilities = ChatCapabilities()


EnvFactory = Callable[..., AgentEnv]  # (resources: EnvResources, **kwargs) -> AgentEnv

ENVS: Registry[EnvFactory] = Registry("env")


@ENVS.register("tool_env")
def _make_tool_env(resources: EnvResources, *, tools: Sequence[str | Mapping[str, Any]] = ("calculator",),
                   tool_format: str = "hermes", invalid_action_penalty: float = 0.0, tool_error_penalty: float = 0.0,
                   tool_timeout_s: float = 10.0, max_calls_per_action: int = 4, max_result_chars: int = 4000) -> ToolEnv:
    """Any registered tools in any format. tools: names, or {"name": ..., "kwargs": {...}} entries."""
    built = []
    for entry in tools:
        name, kwargs = (entry, {}) if isinstance(entry, str) else (entry.get("name"), dict(entry.get("kwargs", {})))
        if not isinstance(name, str):
            raise ValueError(f"env 'tool_env': a tools entry needs a name, got {entry!r}; valid tools: {', '.join(TOOLS.names())}")
        built.append(make_tool(name, kwargs, resources))
    return ToolEnv(built, tool_format, chat=resources.chat, invalid_action_penalty=invalid_action_penalty,
                   tool_error_penalty=tool_error_penalty, tool_timeout_s=tool_timeout_s,
                   max_calls_per_action=max_calls_per_action, max_result_chars=max_result_chars)


@ENVS.register("search_qa")
def _make_search_qa(resources: EnvResources, *, top_k: int = 3, tool_format: str = "tag",
                    invalid_action_penalty: float = 0.0, tool_error_penalty: float = 0.0,
                    tool_timeout_s: float = 10.0) -> ToolEnv:
    """Multi-hop QA (Search-R1 / Agent-R1): the `search` tool over the corpus, then `<answer>`."""
    if resources.search_index is None:
        raise ValueError(
            "env 'search_qa' needs a corpus to search: EnvResources.search_index is None "
            "(build a Bm25Index from the dataset's documents)"
        )
    search = make_tool("search", {"top_k": top_k}, resources)
    return ToolEnv([search], tool_format, chat=resources.chat, invalid_action_penalty=invalid_action_penalty,
                   tool_error_penalty=tool_error_penalty, tool_timeout_s=tool_timeout_s)


def env_kwarg_names(name: str) -> list[str]:
    """The keyword arguments env `name` accepts (UnknownNameError for an unknown env)."""
    return ENVS.kwarg_names(name)


def check_env_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Raise TypeError naming the env and the bad keys if `kwargs` has a key env `name` does not take."""
    ENVS.check_kwargs(name, kwargs)


def make_env(name: str, kwargs: dict[str, Any], resources: EnvResources) -> AgentEnv:
    """Build env `name` with `kwargs` (e.g. a prompt's env_name and env_kwargs)."""
    check_env_kwargs(name, kwargs)
    return ENVS.get(name)(resources, **kwargs)
