"""The driver registry, what a driver is given (`RolloutRequest`) and the one dispatcher (`roll_out`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from agent_core.config import RolloutConfig
from agent_core.envs.registry import env_driver
from agent_core.registry import Registry
from agent_core.rollout.agent_loop import RolloutTimings
from agent_core.rollout.engine import Engine
from agent_core.rollout.records import StepRecord
from agent_core.rollout.spec import RolloutSpec, env_for
from agent_core.types import Document, Prompt


@dataclass(frozen=True)
class DataAccess:
    """What an env's own program may read of the run's data root (env agent_program):
    `corpus_path` (the corpus table, AGENTR1_CORPUS) and nothing else of `private_root`.
    None: no corpus / no jail (a library caller, tests)."""

    corpus_path: str | None = None
    private_root: str | None = None


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout as every driver takes it. `rollout`: the run's rollout section (which env each
    prompt runs in: `env_of`); `spec`: its loop and sampling settings (eval's are `for_eval`'s);
    `timings`: where the time outside generate went (bench/rollout.py), added to in place."""

    engine: Engine
    tokenizer: Any
    documents: Sequence[Document]
    rollout: RolloutConfig
    spec: RolloutSpec
    seed: int
    policy_version: int = 0
    episode_prefix: str = ""
    group_size: int | None = None
    timings: RolloutTimings = field(default_factory=RolloutTimings)
    access: DataAccess = DataAccess()
    preflight: bool = False  # a run's first rollout: a driver that can fail fast does (the program driver)

    def env_of(self, prompt: Prompt) -> tuple[str, dict]:
        """The env (name, kwargs) `prompt` runs in under this rollout (rollout/spec.py `env_for`)."""
        return env_for(prompt, self.rollout)


RolloutDriver = Callable[[RolloutRequest, list[Prompt]], list[StepRecord]]
"""(request, prompts whose envs all name this driver) -> their episodes' steps, in episode order."""

DRIVERS: Registry[RolloutDriver] = Registry("rollout driver")


def roll_out(engine: Engine, tokenizer, prompts: Sequence[Prompt], documents: Sequence[Document],
             rollout: RolloutConfig, *, seed: int, policy_version: int = 0, episode_prefix: str = "",
             spec: RolloutSpec | None = None, group_size: int | None = None,
             timings: RolloutTimings | None = None, access: DataAccess, preflight: bool = False) -> list[StepRecord]:
    """Episodes of `prompts` (group_size each, default the spec's) in `rollout`'s envs: each prompt
    goes to the driver its env names; the drivers run in name order, so their steps come driver by
    driver, in each driver's episode order. `spec` defaults to `RolloutSpec.from_config(rollout)`.
    `access` has no default: a caller that runs agent programs without the run's corpus
    (`DataAccess()`) says so, since their search then finds nothing and nothing else fails."""
    request = RolloutRequest(engine, tokenizer, documents, rollout,
                             RolloutSpec.from_config(rollout) if spec is None else spec, seed, policy_version,
                             episode_prefix, group_size, RolloutTimings() if timings is None else timings,
                             access, preflight)
    by_driver: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_driver.setdefault(env_driver(request.env_of(prompt)[0]), []).append(prompt)
    steps: list[StepRecord] = []
    for name in sorted(by_driver):
        steps += DRIVERS.get(name)(request, by_driver[name])
    return steps
