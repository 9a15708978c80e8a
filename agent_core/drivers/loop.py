"""Driver `agent_loop`: the in-process agent loop (agent_core/rollout/agent_loop.py) over registered envs."""

from __future__ import annotations

import time

from agent_core.drivers.base import DRIVERS, RolloutRequest
from agent_core.envs.registry import LOOP_DRIVER, make_env
from agent_core.rollout.agent_loop import run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.records import StepRecord
from agent_core.rollout.spec import env_resources
from agent_core.types import Prompt


@DRIVERS.register(LOOP_DRIVER)
def loop_driver(request: RolloutRequest, prompts: list[Prompt]) -> list[StepRecord]:
    """Every prompt's env built in this process, over one shared search index (built once per corpus)."""
    started = time.perf_counter()
    resources = env_resources(request.tokenizer, request.documents)
    request.timings.index_seconds += time.perf_counter() - started
    spec = request.spec
    return run_episodes(request.engine, request.tokenizer, prompts,
                        lambda prompt: make_env(*request.env_of(prompt), resources),
                        spec.sampling(request.seed, eos_token_ids(request.tokenizer)),
                        spec.loop(request.policy_version, request.episode_prefix, request.group_size),
                        request.timings)
