"""The multi-step agent loop: many episodes against one engine, one step = one LLM call + env answer.

Every unfinished episode's next request goes into the same `engine.generate` call, so the engine
batches across episodes and turns. Contexts are token ids end to end: step k+1's context is step
k's context + the sampled action ids + the rendered observation ids (append-everything context
management), never a re-encoding of decoded text (DESIGN.md §6).

Budgets belong to the loop, not to envs: an episode ends when the env says done, after
`max_steps` LLM calls ("max_steps"), or when the next context plus one action would not fit in
`max_context_tokens` ("max_context").
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from agent_core.envs.base import AgentEnv, EnvStep
from agent_core.rollout.chat import encode_conversation, encode_observation, eos_token_ids
from agent_core.rollout.engine import Engine, Generation, SamplingParams
from agent_core.rollout.records import StepRecord
from agent_core.types import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSettings:
    group_size: int
    max_steps: int
    max_context_tokens: int
    policy_version: int
    episode_prefix: str = ""  # makes episode ids unique across runs and iterations


@dataclass
class _Episode:
    episode_id: str
    group_id: str
    prompt: Prompt
    sample_idx: int
    env: AgentEnv
    context_ids: list[int]
    step_idx: int = 0
    records: list[StepRecord] = field(default_factory=list)


def run_episodes(
    engine: Engine,
    tokenizer,
    prompts: Sequence[Prompt],
    make_env: Callable[[Prompt], AgentEnv],
    sampling: SamplingParams,
    settings: LoopSettings,
) -> list[StepRecord]:
    """Roll out `group_size` episodes per prompt to the end; return their steps in episode order."""
    episodes = _start_episodes(tokenizer, prompts, make_env, settings)
    for ep in episodes:
        if not _fits(ep.context_ids, sampling, settings):  # nothing could ever be generated
            raise ValueError(
                f"prompt {ep.prompt.prompt_id!r} is {len(ep.context_ids)} tokens; with max_new_tokens="
                f"{sampling.max_new_tokens} it exceeds max_context_tokens={settings.max_context_tokens}"
            )
    active = list(episodes)
    turn = 0
    while active:
        seed = None if sampling.seed is None else sampling.seed + turn
        params = SamplingParams(**{**asdict(sampling), "seed": seed})
        generations = engine.generate([ep.context_ids for ep in active], params)
        active = [ep for ep, gen in zip(active, generations) if _advance(ep, gen, tokenizer, sampling, settings)]
        turn += 1
        log.info("turn %d: %d episodes still running", turn, len(active))
    return [record for ep in episodes for record in ep.records]


def _start_episodes(tokenizer, prompts, make_env, settings: LoopSettings) -> list[_Episode]:
    episodes = []
    for prompt in prompts:
        for sample_idx in range(settings.group_size):
            env = make_env(prompt)
            messages = env.reset(prompt)
            group_id = f"{settings.episode_prefix}{prompt.prompt_id}"
            episodes.append(
                _Episode(
                    episode_id=f"{group_id}-s{sample_idx}",
                    group_id=group_id,
                    prompt=prompt,
                    sample_idx=sample_idx,
                    env=env,
                    context_ids=encode_conversation(tokenizer, messages),
                )
            )
    return episodes


def _fits(context_ids: list[int], sampling: SamplingParams, settings: LoopSettings) -> bool:
    """Room for the context plus one full action."""
    return len(context_ids) + sampling.max_new_tokens <= settings.max_context_tokens


def _advance(ep: _Episode, gen: Generation, tokenizer, sampling: SamplingParams, settings: LoopSettings) -> bool:
    """Apply one generation to its episode; return True if the episode goes on."""
    action_text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    outcome = ep.env.step(action_text)
    termination = outcome.termination if outcome.done else None
    next_context: list[int] | None = None
    if not outcome.done:
        # a stop token other than end-of-turn (e.g. "</search>") would leave the turn open
        ended_with_eos = bool(gen.token_ids) and gen.token_ids[-1] in eos_token_ids(tokenizer)
        observation_ids = encode_observation(tokenizer, ep.env.observation_role, outcome.observation, ended_with_eos)
        next_context = ep.context_ids + gen.token_ids + observation_ids
        if ep.step_idx + 1 >= settings.max_steps:
            termination = "max_steps"
        elif not _fits(next_context, sampling, settings):
            termination = "max_context"
    done = termination is not None
    ep.records.append(_record(ep, gen, action_text, outcome, done, termination, settings))
    if done:
        return False
    ep.context_ids = next_context
    ep.step_idx += 1
    return True


def _record(ep: _Episode, gen: Generation, action_text: str, outcome: EnvStep, done: bool,
            termination: str | None, settings: LoopSettings) -> StepRecord:
    return StepRecord(
        episode_id=ep.episode_id,
        group_id=ep.group_id,
        prompt_id=ep.prompt.prompt_id,
        sample_idx=ep.sample_idx,
        step_idx=ep.step_idx,
        policy_version=settings.policy_version,
        prompt_ids=list(ep.context_ids),
        response_ids=list(gen.token_ids),
        response_logprobs=list(gen.logprobs),
        response_text=action_text,
        tool_calls=json.dumps([{"name": c.name, "arguments": c.arguments} for c in outcome.tool_calls]),
        parse_error=outcome.parse_error,
        observation_text=outcome.observation,
        env_reward=float(outcome.reward),
        done=done,
        termination=termination,
        finish_reason=gen.finish_reason,
        prefix_shared=not done,  # append-everything: the next context extends this one
        info=json.dumps(outcome.info, default=str),
    )
