"""An episode's gateway calls as its steps: the agent loop's `StepRecord`s, one per call, in order.

Step k is call k; its `history` ("appended" or "rewritten") says how its prompt relates to step k-1's
(schemas/steps.py). How the episode ended goes on its last step, as for any env: "answered" (answer in
info["answer"]; also after a budget refusal, info["refused"]), a budget's truncation when the program
printed no answer or a blank one ("max_steps" when no request was refused), or "error" (reason in
info["error"]). A program that failed before making any call leaves one step with no action
(`records.no_action_step`): it is counted, never trained on.
Design notes: docs/architecture.md §11 (agent_core/gateway/steps.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from agent_core.gateway.core import EpisodeCalls, GatewayCall
from agent_core.rollout.agent_loop import TRUNCATIONS, opening_anchor
from agent_core.rollout.context import extends
from agent_core.rollout.records import EpisodeIdentity, StepRecord, json_text

HISTORY_START, HISTORY_APPENDED, HISTORY_REWRITTEN = "start", "appended", "rewritten"


@dataclass(frozen=True)
class EpisodeEnd:
    """How the agent's program ended: its answer, or why it failed (one line), plus what to keep in info."""

    answer: str | None
    failure: str | None
    info: dict[str, Any]
    agent_rewards: Mapping[str, float] = field(default_factory=dict)  # env_reward of each named agent's last step


def history_of(prompt_ids: list[int], previous: GatewayCall | StepRecord | None) -> str:
    """How a step's prompt relates to the previous step's (module docstring)."""
    if previous is None:
        return HISTORY_START
    appended = extends(prompt_ids, [*previous.prompt_ids, *previous.response_ids])
    return HISTORY_APPENDED if appended else HISTORY_REWRITTEN


def termination_of(calls: EpisodeCalls, end: EpisodeEnd) -> tuple[str, dict[str, Any]]:
    """(termination, what the last step's info gets) for an episode that made calls. A blank answer
    is no answer: the program stopped without one (its own turn limit, e.g. the example agent's
    --max-turns), which ends the episode as the loop's step budget would, never as an answer that
    earns the format reward."""
    if end.failure is not None:
        return "error", {"error": end.failure}
    if end.answer is None or not end.answer.strip():
        blank = {} if end.answer is None else {"unanswered": "the program printed a blank answer"}
        return calls.budget_hit or "max_steps", blank
    # an answer printed after a refusal is the agent's answer, scored like any other
    refused = {} if calls.budget_hit is None else {"refused": calls.budget_hit}
    return "answered", {"answer": end.answer, **refused}


def steps_from_calls(identity: EpisodeIdentity, calls: EpisodeCalls, end: EpisodeEnd,
                     tokenizer=None) -> list[StepRecord]:
    """The episode's steps (module docstring); [] when it made no call. `tokenizer`: to decode each
    observation into observation_text (else left empty). Calls a program made as named agents are
    each agent's own episode (`<episode>@<agent>` in the group `<group>@<agent>`, so an agent is
    compared with the same agent of the other samples), ending as the program's run ended."""
    by_agent: dict[str | None, list[GatewayCall]] = {}
    for call in calls.calls:
        by_agent.setdefault(call.agent, []).append(call)
    records: list[StepRecord] = []
    for agent, own in by_agent.items():
        named = identity if agent is None else replace(identity, episode_id=f"{identity.episode_id}@{agent}",
                                                       group_id=f"{identity.group_id}@{agent}")
        records += _agent_steps(named, replace(calls, calls=tuple(own)), end, tokenizer)
    return records


def _agent_steps(identity: EpisodeIdentity, calls: EpisodeCalls, end: EpisodeEnd, tokenizer) -> list[StepRecord]:
    """One agent's calls as the steps of one episode."""
    records: list[StepRecord] = []
    last_idx = len(calls.calls) - 1
    # each step's history once: step k shares its prefix with step k+1 exactly when k+1 appended
    histories = [history_of(call.prompt_ids, calls.calls[k - 1] if k else None) for k, call in enumerate(calls.calls)]
    for k, call in enumerate(calls.calls):
        done = k == last_idx
        following = None if done else calls.calls[k + 1]
        shared = following is not None and histories[k + 1] == HISTORY_APPENDED
        termination, end_info = termination_of(calls, end) if done else (None, {})
        observation = ""
        if shared:  # the ids the agent's new messages added, as text
            observation = _decode_observation(tokenizer, following, call)
        info = {"gateway": True, "seed": call.seed, "generate_seconds": call.generate_seconds,
                "batch_size": call.batch_size,
                **({"requested": json.loads(call.requested)} if call.requested != "{}" else {}),
                **(end.info if done else {}), **end_info}
        records.append(StepRecord(
            episode_id=identity.episode_id, group_id=identity.group_id, prompt_id=identity.prompt_id,
            sample_idx=identity.sample_idx, step_idx=k,
            policy_version=identity.policy_version if call.policy_version is None else call.policy_version,
            prompt_ids=list(call.prompt_ids), response_ids=list(call.response_ids),
            response_logprobs=list(call.response_logprobs), response_text=call.response_text,
            tool_calls=call.tool_calls, parse_error=call.parse_error, observation_text=observation,
            env_reward=end.agent_rewards.get(call.agent, 0.0) if done and call.agent else 0.0, done=done,
            termination=termination, truncated=termination in TRUNCATIONS,
            finish_reason=call.finish_reason, prefix_shared=shared, info=json_text(info),
            served_by=call.served_by, retries=call.retries, generated_at=call.generated_at,
            anchor=opening_anchor(call.prompt_ids) if k == 0 else None,
            history=histories[k], agent=call.agent,
        ))
    return records


def _decode_observation(tokenizer, following: GatewayCall, call: GatewayCall) -> str:
    if tokenizer is None:
        return ""
    start = len(call.prompt_ids) + len(call.response_ids)
    return tokenizer.decode(following.prompt_ids[start:], skip_special_tokens=True)
