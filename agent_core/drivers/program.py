"""Driver `agent_program`: the user's own program, one run per episode, through the gateway
(agent_core/gateway/program_rollout.py), jailed when the request names a private data root. The
gateway (fastapi, uvicorn) is imported on first use, so the loop driver's users (bench/gpu.py) need
neither installed."""

from __future__ import annotations

from agent_core.drivers.base import DRIVERS, RolloutRequest
from agent_core.envs.agent_program import ProgramJail
from agent_core.envs.program_spec import ENV_NAME, ProgramSpec
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.records import StepRecord
from agent_core.rollout.spec import chat_capabilities
from agent_core.types import Prompt


@DRIVERS.register(ENV_NAME)
def program_driver(request: RolloutRequest, prompts: list[Prompt]) -> list[StepRecord]:
    """Prompts grouped by program (their env kwargs), each group's episodes through one gateway."""
    from agent_core.gateway.program_rollout import ProgramRollout, run_program_episodes

    access, spec, tokenizer = request.access, request.spec, request.tokenizer
    jail = None if access.private_root is None else ProgramJail.around([access.private_root], [access.corpus_path])
    chat = chat_capabilities(tokenizer)
    by_program: dict[ProgramSpec, list[Prompt]] = {}
    for prompt in prompts:
        by_program.setdefault(ProgramSpec.from_env_kwargs(request.env_of(prompt)[1]), []).append(prompt)
    settings = ProgramRollout(group_size=request.group_size or spec.group_size, max_calls=spec.max_steps,
                              max_context_tokens=spec.max_context_tokens, policy_version=request.policy_version,
                              episode_prefix=request.episode_prefix, corpus_path=access.corpus_path, jail=jail,
                              preflight=request.preflight)
    steps: list[StepRecord] = []
    for program, group in by_program.items():
        steps += run_program_episodes(request.engine, tokenizer, group, program,
                                      spec.sampling(request.seed, eos_token_ids(tokenizer)), settings, chat)
    return steps
