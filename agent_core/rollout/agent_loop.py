"""The multi-step agent loop: many episodes against one engine, one step = one LLM call + env answer.

Every episode whose next context is ready goes into the same `engine.generate` call, so the engine
batches across episodes and turns. Env steps (tool calls) run in a thread pool; the loop waits for
all of them up to `straggler_wait_s`, then goes on with the episodes that are ready, so one slow
tool does not hold up the batch (with stragglers, which episodes share a batch depends on timing).

Contexts are token ids end to end: the next context is built by `agent_core.rollout.context` from
the exact ids of the previous context, the sampled action and the rendered observation, never from
re-encoded text (DESIGN.md §6). The ids each call received are recorded as the step's prompt_ids.

Budgets belong to the loop, not to envs: an episode ends when the env says done ("answered"), when
the env raises ("error"; the exception is recorded in info and the rollout goes on), after
`max_steps` LLM calls ("max_steps") or when the next context plus one action would not fit in
`max_context_tokens` ("max_context"). The last two are truncations (the agent was cut off, the
task did not end) and are recorded with truncated=True.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from agent_core.envs.base import AgentEnv, EnvStep
from agent_core.rollout.chat import encode_conversation, encode_observation_messages, eos_token_ids
from agent_core.rollout.context import ContextPolicy, EpisodeContext, extends, truncate_text
from agent_core.rollout.engine import Engine, Generation, SamplingParams
from agent_core.rollout.records import StepRecord
from agent_core.types import ChatMessage, Prompt

log = logging.getLogger(__name__)

TRUNCATIONS = ("max_steps", "max_context")


@dataclass(frozen=True)
class LoopSettings:
    group_size: int
    max_steps: int
    max_context_tokens: int
    policy_version: int
    episode_prefix: str = ""  # makes episode ids unique across runs and iterations
    context: ContextPolicy = field(default_factory=ContextPolicy)
    env_workers: int = 8  # threads running env steps (tool calls) concurrently
    straggler_wait_s: float = 2.0  # how long a batch waits for slow env steps before going on


@dataclass
class _Episode:
    episode_id: str
    group_id: str
    prompt: Prompt
    sample_idx: int
    env: AgentEnv
    context: EpisodeContext
    current_ids: list[int]
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
        if not _fits(ep.current_ids, sampling, settings):  # nothing could ever be generated
            raise ValueError(
                f"prompt {ep.prompt.prompt_id!r} is {len(ep.current_ids)} tokens; with max_new_tokens="
                f"{sampling.max_new_tokens} it exceeds max_context_tokens={settings.max_context_tokens}"
            )
    ready, pending = list(episodes), {}
    turn, finished = 0, 0
    with ThreadPoolExecutor(max_workers=settings.env_workers, thread_name_prefix="agentr1-env") as pool:
        while ready or pending:
            if ready:
                seed = None if sampling.seed is None else sampling.seed + turn
                generations = engine.generate([ep.current_ids for ep in ready], SamplingParams(**{**asdict(sampling), "seed": seed}))
                for ep, gen in zip(ready, generations):
                    action_text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                    pending[pool.submit(_env_step, ep.env, action_text)] = (ep, gen, action_text)
                ready, turn = [], turn + 1
            for future in _collect(pending, settings.straggler_wait_s):
                ep, gen, action_text = pending.pop(future)
                if _advance(ep, gen, action_text, future.result(), tokenizer, sampling, settings):
                    ready.append(ep)
                else:
                    finished += 1
            log.info("turn %d: %d/%d episodes finished", turn, finished, len(episodes))
    return [record for ep in episodes for record in ep.records]


def _collect(pending: dict[Future, tuple], straggler_wait_s: float) -> set[Future]:
    """Env steps that are done: all of them if they finish within the wait, else at least one."""
    done, _ = wait(pending, timeout=straggler_wait_s, return_when=ALL_COMPLETED)
    if not done:
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
    return done


def _env_step(env: AgentEnv, action_text: str) -> EnvStep:
    """The env's answer; an env that raises ends its episode with termination "error"."""
    started = time.perf_counter()
    try:
        outcome = env.step(action_text)
    except Exception as error:  # an env bug must not take down the other episodes of the rollout
        log.warning("env %s raised %s: %s", type(env).__name__, type(error).__name__, error)
        outcome = EnvStep(
            observation="", reward=0.0, done=True, termination="error",
            info={"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(limit=20)},
        )
    outcome.info.setdefault("env_seconds", round(time.perf_counter() - started, 6))
    return outcome


def _start_episodes(tokenizer, prompts, make_env, settings: LoopSettings) -> list[_Episode]:
    episodes = []
    for prompt in prompts:
        for sample_idx in range(settings.group_size):
            env = make_env(prompt)
            head = encode_conversation(tokenizer, env.reset(prompt), tools=_template_tools(env))
            group_id = f"{settings.episode_prefix}{prompt.prompt_id}"
            episodes.append(_Episode(
                episode_id=f"{group_id}-s{sample_idx}", group_id=group_id, prompt=prompt, sample_idx=sample_idx,
                env=env, context=EpisodeContext(head=head), current_ids=list(head),
            ))
    return episodes


def _fits(context_ids: list[int], sampling: SamplingParams, settings: LoopSettings) -> bool:
    """Room for the context plus one full action."""
    return len(context_ids) + sampling.max_new_tokens <= settings.max_context_tokens


def _advance(ep: _Episode, gen: Generation, action_text: str, outcome: EnvStep, tokenizer,
             sampling: SamplingParams, settings: LoopSettings) -> bool:
    """Apply one generation and the env's answer to its episode; return True if the episode goes on."""
    termination = outcome.termination if outcome.done else None
    messages = _observation_messages(ep.env, outcome, tokenizer, settings)
    observation = "\n".join(m.content for m in messages)
    next_ids: list[int] | None = None
    if not outcome.done:
        # a stop token other than end-of-turn (e.g. "</search>") would leave the turn open
        ended_with_eos = bool(gen.token_ids) and gen.token_ids[-1] in eos_token_ids(tokenizer)
        observation_ids = encode_observation_messages(tokenizer, messages, ended_with_eos, tools=_template_tools(ep.env))
        ep.context.add_turn(gen.token_ids, observation_ids)
        next_ids = ep.context.ids(settings.context)
        if ep.step_idx + 1 >= settings.max_steps:
            termination = "max_steps"
        elif not _fits(next_ids, sampling, settings):
            termination = "max_context"
    done = termination is not None
    prefix_shared = not done and extends(next_ids, ep.current_ids + list(gen.token_ids))
    ep.records.append(_record(ep, gen, action_text, outcome, observation, termination, prefix_shared, settings))
    if done:
        return False
    ep.current_ids = next_ids
    ep.step_idx += 1
    return True


def _template_tools(env: AgentEnv) -> list[dict] | None:
    return getattr(env, "tools_for_template", None)


def _observation_messages(env: AgentEnv, outcome: EnvStep, tokenizer, settings: LoopSettings) -> list[ChatMessage]:
    """The observation as messages, each cut to max_observation_tokens (the cut is noted in info)."""
    messages = list(outcome.observation_messages) or [ChatMessage(env.observation_role, outcome.observation)]
    limit, total_cut = settings.context.max_observation_tokens, 0
    for i, message in enumerate(messages):
        text, cut = truncate_text(tokenizer, message.content, limit)
        if cut:
            messages[i], total_cut = ChatMessage(message.role, text), total_cut + cut
    if total_cut:
        outcome.info["observation_tokens_cut"] = total_cut
    return messages


def _record(ep: _Episode, gen: Generation, action_text: str, outcome: EnvStep, observation: str,
            termination: str | None, prefix_shared: bool, settings: LoopSettings) -> StepRecord:
    return StepRecord(
        episode_id=ep.episode_id,
        group_id=ep.group_id,
        prompt_id=ep.prompt.prompt_id,
        sample_idx=ep.sample_idx,
        step_idx=ep.step_idx,
        policy_version=settings.policy_version,
        prompt_ids=list(ep.current_ids),
        response_ids=list(gen.token_ids),
        response_logprobs=list(gen.logprobs),
        response_text=action_text,
        tool_calls=json.dumps([_call_json(call) for call in outcome.tool_calls], default=str),
        parse_error=outcome.parse_error,
        observation_text=observation,
        env_reward=float(outcome.reward),
        done=termination is not None,
        termination=termination,
        truncated=termination in TRUNCATIONS,
        finish_reason=gen.finish_reason,
        prefix_shared=prefix_shared,
        info=json.dumps(outcome.info, default=str),
    )


def _call_json(call) -> dict:
    return asdict(call)
