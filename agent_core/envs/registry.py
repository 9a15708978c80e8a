"""Envs by name: a prompt's `env_name` + `env_kwargs` (plus shared resources) build its env.

A factory takes the rollout's shared, read-only resources (built once per rollout, e.g. the search
index) and the prompt's keyword arguments. `make_env` checks the keyword names against the factory
before calling it, so a bad key in a dataset or config names the env and the valid keys.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from agent_core.envs.base import AgentEnv
from agent_core.envs.search import Bm25Index
from agent_core.envs.search_qa import SearchQAEnv
from agent_core.registry import Registry


@dataclass(frozen=True)
class EnvResources:
    """What envs share across a rollout. search_index: the corpus, for envs that search."""

    search_index: Bm25Index | None = None


EnvFactory = Callable[..., AgentEnv]  # (resources: EnvResources, **kwargs) -> AgentEnv

ENVS: Registry[EnvFactory] = Registry("env")


@ENVS.register("search_qa")
def _make_search_qa(resources: EnvResources, *, top_k: int = 3, invalid_action_penalty: float = 0.0) -> SearchQAEnv:
    if resources.search_index is None:
        raise ValueError(
            "env 'search_qa' needs a corpus to search: EnvResources.search_index is None "
            "(build a Bm25Index from the dataset's documents)"
        )
    return SearchQAEnv(resources.search_index, top_k=top_k, invalid_action_penalty=invalid_action_penalty)


def env_kwarg_names(name: str) -> list[str]:
    """The keyword arguments env `name` accepts (UnknownNameError for an unknown env)."""
    parameters = list(inspect.signature(ENVS.get(name)).parameters.values())[1:]  # after resources
    return [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_env_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Raise TypeError naming the env and the bad keys if `kwargs` has a key env `name` does not take."""
    valid = env_kwarg_names(name)
    unexpected = sorted(set(kwargs) - set(valid))
    if unexpected:
        raise TypeError(
            f"env {name!r} got unexpected argument(s) {', '.join(map(repr, unexpected))}; "
            f"valid arguments: {', '.join(valid) or '(none)'}"
        )


def make_env(name: str, kwargs: dict[str, Any], resources: EnvResources) -> AgentEnv:
    """Build env `name` with `kwargs` (e.g. a prompt's env_name and env_kwargs)."""
    check_env_kwargs(name, kwargs)
    return ENVS.get(name)(resources, **kwargs)
