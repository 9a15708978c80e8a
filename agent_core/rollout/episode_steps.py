"""One episode of the agent loop (agent_core/rollout/agent_loop.py schedules many): its settings,
its state, how it opens, and how one generation plus the env's answer becomes its next step.

Contexts are token ids end to end, never re-encoded text (docs/architecture.md §6). Budgets belong to the
loop, not to envs: an episode ends "answered", "error", "max_steps" or "max_context" (the last two are
truncations). Each step records the anchor of the state it STARTS from (GiGPO, agent_core/algos/gigpo.py).
Design notes: docs/architecture.md §11 (agent_core/rollout/episode_steps.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, fields

from agent_core.envs.base import AgentEnv, EnvStep
from agent_core.rollout.chat import encode_conversation
from agent_core.rollout.context import ContextPolicy, EpisodeContext, extends, truncate_text
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.rollout.observation_encoder import ObservationEncoder
from agent_core.rollout.records import TRUNCATIONS, StepRecord, json_text
from agent_core.types import ChatMessage, Prompt


@dataclass(frozen=True)
class LoopSettings:
    """How one rollout runs.

    straggler_wait_s: with a serial engine (one `generate` call at a time), how long a free engine
        waits for pending env steps (tool calls) before generating for the episodes already ready.
        Fast tools then share one call; a slow tool delays the others by at most this much per step.
        Large (float("inf") works) means lock-step turns: every call holds all unfinished episodes,
        which makes seeded sampling reproducible run to run. Engines that take concurrent calls
        never wait (agent_core/rollout/agent_loop.py's docstring).
    """

    group_size: int
    max_steps: int
    max_context_tokens: int
    policy_version: int
    episode_prefix: str = ""  # makes episode ids unique across runs and iterations
    context: ContextPolicy = field(default_factory=ContextPolicy)
    env_workers: int = 8  # threads running env steps (tool calls) concurrently
    straggler_wait_s: float = 2.0  # see the class docstring


@dataclass
class LiveEpisode:
    """One episode's state while the loop runs it (touched only on the loop's calling thread)."""

    index: int  # position in the rollout: the order of episodes within a generate call
    episode_id: str
    group_id: str
    prompt: Prompt
    sample_idx: int
    env: AgentEnv
    context: EpisodeContext
    current_ids: list[int]
    step_idx: int = 0
    records: list[StepRecord] = field(default_factory=list)
    ready_since: float = 0.0  # perf_counter time its current context became ready to generate from
    anchor: str | None = None  # the anchor of the state its next step starts from (module docstring)


def start_episodes(tokenizer, prompts, make_env, settings: LoopSettings) -> list[LiveEpisode]:
    episodes = []
    heads: dict[tuple, list[int]] = {}  # a group's episodes usually open with the same conversation
    for prompt in prompts:
        for sample_idx in range(settings.group_size):
            env = make_env(prompt)
            messages, tools = tuple(env.reset(prompt)), _template_tools(env)
            key = (messages, json.dumps(tools, default=repr) if tools else None)
            if key not in heads:
                heads[key] = encode_conversation(tokenizer, messages, tools=tools)
            head = heads[key]
            group_id = f"{settings.episode_prefix}{prompt.prompt_id}"
            episodes.append(LiveEpisode(
                index=len(episodes), episode_id=f"{group_id}-s{sample_idx}", group_id=group_id, prompt=prompt,
                sample_idx=sample_idx, env=env, context=EpisodeContext(head=list(head)), current_ids=list(head),
                anchor=opening_anchor(head),
            ))
    return episodes


def opening_anchor(head: list[int]) -> str:
    """The anchor of an episode's first state: a hash of its opening context's token ids."""
    digest = hashlib.blake2b(json.dumps(head).encode(), digest_size=8).hexdigest()
    return f"start:{digest}"


def fits(context_ids: list[int], sampling: SamplingParams, settings: LoopSettings) -> bool:
    """Room for the context plus one full action."""
    return len(context_ids) + sampling.max_new_tokens <= settings.max_context_tokens


def advance(ep: LiveEpisode, gen: Generation, action_text: str, outcome: EnvStep, tokenizer,
            encoder: ObservationEncoder, sampling: SamplingParams, settings: LoopSettings,
            end_of_turn_ids: frozenset[int]) -> bool:
    """Apply one generation and the env's answer to its episode; return True if the episode goes on."""
    termination = outcome.termination if outcome.done else None
    generated_at = outcome.info.pop("generated_at", time.time())
    messages = _observation_messages(ep.env, outcome, tokenizer, settings)
    observation = "\n".join(m.content for m in messages)
    next_ids: list[int] | None = None
    if not outcome.done:
        # a stop token other than end-of-turn (e.g. "</search>") would leave the turn open
        ended_with_eos = bool(gen.token_ids) and gen.token_ids[-1] in end_of_turn_ids
        observation_ids = encoder.encode(messages, ended_with_eos, tools=_template_tools(ep.env))
        ep.context.add_turn(gen.token_ids, observation_ids)
        next_ids = ep.context.ids(settings.context)
        if ep.step_idx + 1 >= settings.max_steps:
            termination = "max_steps"
        elif not fits(next_ids, sampling, settings):
            termination = "max_context"
    done = termination is not None
    prefix_shared = not done and extends(next_ids, ep.current_ids + list(gen.token_ids))
    ep.records.append(_record(ep, gen, action_text, outcome, observation, termination, prefix_shared, settings,
                              generated_at))
    ep.anchor = outcome.anchor  # the state the next step starts from
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


def _record(ep: LiveEpisode, gen: Generation, action_text: str, outcome: EnvStep, observation: str,
            termination: str | None, prefix_shared: bool, settings: LoopSettings, generated_at: float) -> StepRecord:
    return StepRecord(
        episode_id=ep.episode_id,
        group_id=ep.group_id,
        prompt_id=ep.prompt.prompt_id,
        sample_idx=ep.sample_idx,
        step_idx=ep.step_idx,
        policy_version=settings.policy_version if gen.policy_version is None else gen.policy_version,
        prompt_ids=list(ep.current_ids),
        response_ids=list(gen.token_ids),
        response_logprobs=list(gen.logprobs),
        response_text=action_text,
        tool_calls=json_text([_call_json(call) for call in outcome.tool_calls]),
        parse_error=outcome.parse_error,
        observation_text=observation,
        env_reward=float(outcome.reward),
        done=termination is not None,
        termination=termination,
        truncated=termination in TRUNCATIONS,
        finish_reason=gen.finish_reason,
        prefix_shared=prefix_shared,
        info=json_text(outcome.info),
        served_by=gen.served_by,
        retries=gen.retries,
        generated_at=generated_at,
        anchor=ep.anchor,
        history=_history(ep),
    )


def _history(ep: LiveEpisode) -> str:
    """How the step's context relates to the previous step's (StepRecord.history)."""
    if not ep.records:
        return "start"
    return "appended" if ep.records[-1].prefix_shared else "rewritten"


def _call_json(call) -> dict:
    """The call's fields, shallow: asdict() would deep-copy model-written arguments, recursively."""
    return {f.name: getattr(call, f.name) for f in fields(call)}
