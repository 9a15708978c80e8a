"""A run's rollout as the agent loop and the engine take it: ONE place that turns the config's
`rollout` section into `LoopSettings` and `SamplingParams` (`RolloutSpec`), and decides which env a
prompt runs in (`env_for`). Training, eval (`for_eval`: one greedy episode per prompt, training's
context policy and budgets) and the dev eval all build their loop here; the rollout drivers
(agent_core/drivers) run it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from agent_core.config import RolloutConfig
from agent_core.envs.registry import ENVS, EnvResources, env_kwarg_names
from agent_core.envs.search import shared_index
from agent_core.envs.tool_env import ChatCapabilities
from agent_core.rollout.agent_loop import LoopSettings
from agent_core.rollout.chat import template_supports_tool_role, template_supports_tools
from agent_core.rollout.context import ContextPolicy
from agent_core.rollout.engine import SamplingParams
from agent_core.types import Document, Prompt


@dataclass(frozen=True)
class RolloutSpec:
    """What one rollout samples and how its loop runs (plain values: a stage manifest or an MLflow
    param can hold it). Built by `from_config`; the defaults are RolloutConfig's."""

    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    max_steps: int = 4
    max_context_tokens: int = 1024
    group_size: int = 4
    context: ContextPolicy = ContextPolicy()
    env_workers: int = 8
    straggler_wait_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_steps", "max_context_tokens", "group_size", "env_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutSpec needs temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> "RolloutSpec":
        return cls(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, max_steps=cfg.max_steps,
            max_context_tokens=cfg.max_context_tokens, group_size=cfg.group_size,
            context=ContextPolicy(cfg.context_mode, cfg.keep_last_turns, cfg.max_observation_tokens),
            env_workers=cfg.env_workers, straggler_wait_s=cfg.straggler_wait_s,
        )

    def for_eval(self, *, greedy: bool, temperature: float | None = None) -> "RolloutSpec":
        """As training, but one episode per prompt, sampled greedily (temperature 0) or at `temperature`
        (default: training's). Everything else (budgets, context policy, top_p) stays training's."""
        chosen = 0.0 if greedy else (self.temperature if temperature is None else temperature)
        if not greedy and chosen <= 0:
            raise ValueError(f"sampled evaluation needs temperature > 0, got {chosen} (or evaluate greedily)")
        return replace(self, temperature=chosen, group_size=1)

    def sampling(self, seed: int, stop_token_ids: Sequence[int] = ()) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=seed, stop_token_ids=tuple(stop_token_ids))

    def loop(self, policy_version: int, episode_prefix: str = "", group_size: int | None = None) -> LoopSettings:
        return LoopSettings(
            group_size=group_size or self.group_size, max_steps=self.max_steps,
            max_context_tokens=self.max_context_tokens, policy_version=policy_version,
            episode_prefix=episode_prefix, context=self.context, env_workers=self.env_workers,
            straggler_wait_s=self.straggler_wait_s,
        )


def env_for(prompt: Prompt, cfg: RolloutConfig) -> tuple[str, dict[str, Any]]:
    """The config's env replaces the prompt's (and its kwargs); config kwargs refine the prompt's own env.
    An env that takes `instructions` gets `cfg.instructions` unless the kwargs say otherwise."""
    if cfg.env is not None and cfg.env != prompt.env_name:
        name, kwargs = cfg.env, dict(cfg.env_kwargs)
    else:
        name, kwargs = prompt.env_name, {**prompt.env_kwargs, **cfg.env_kwargs}
    if "instructions" not in kwargs and name in ENVS.names() and "instructions" in env_kwarg_names(name):
        kwargs["instructions"] = cfg.instructions
    return name, kwargs


def chat_capabilities(tokenizer) -> ChatCapabilities:
    """What the policy's chat template can render (a tools list, a tool role)."""
    return ChatCapabilities(template_supports_tools(tokenizer), template_supports_tool_role(tokenizer))


def env_resources(tokenizer, documents: Sequence[Document]) -> EnvResources:
    """The rollout's shared env resources: the corpus's search index (built once per corpus) and
    what the policy's chat template can render."""
    return EnvResources(search_index=shared_index(list(documents)), chat=chat_capabilities(tokenizer))
