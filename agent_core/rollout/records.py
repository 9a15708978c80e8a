"""One row of the `steps` table as a typed container (one LLM call + the env's answer), the one
builder of a one-step episode (a driver's, the oracle's) and of a step with no action, the count of
failed episodes, the check of an env's answer, and the text helpers that make whatever an env
returns storable in it."""

from __future__ import annotations

import json
from collections import Counter
import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from agent_core.envs.base import TERMINATIONS, EnvStep, ToolCall
from agent_core.rollout.engine import Generation
from agent_core.types import ChatMessage

TRUNCATIONS = ("max_steps", "max_context")  # the terminations that cut an episode off (StepRecord.truncated)
_SURROGATES = re.compile("[\ud800-\udfff]")
_MAX_JSON_DEPTH = 32
_MAX_INT_BITS = 8192  # Python refuses to print ints of more than 4300 digits (~14,000 bits)


@dataclass(frozen=True)
class StepRecord:
    """A step of an episode, exactly as the policy saw and produced it.

    prompt_ids: the full context the engine received (after context management).
    response_ids / response_logprobs: the sampled action and the log-probs of the sampling
        distribution, one for one.
    prefix_shared: the next step's context is prompt_ids + response_ids + observation tokens, so
        the episode's steps can be packed into one training sequence. False on the last step.
    truncated: the episode was cut off by a budget here (termination max_steps / max_context),
        as opposed to ended by the task (answered) or by an error; only on the done row.
    tool_calls / info: JSON text.
    policy_version: the weights that generated the action (a replica's own report, else the loop's).
    served_by / retries: the inference replica that answered (None in-process) and how many replicas
        failed the same call before it. generated_at: unix time the action came back.
    anchor: the key of the state this step started from (schemas/steps.py; None: none known).
    history: how prompt_ids relate to the previous step's: "start", "appended" (they start with its
        prompt + response) or "rewritten" (schemas/steps.py).
    """

    episode_id: str
    group_id: str
    prompt_id: str
    sample_idx: int
    step_idx: int
    policy_version: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    tool_calls: str
    parse_error: str | None
    observation_text: str
    env_reward: float
    done: bool
    termination: str | None
    truncated: bool
    finish_reason: str
    prefix_shared: bool
    info: str
    served_by: str | None = None
    retries: int = 0
    generated_at: float = field(default_factory=time.time)
    anchor: str | None = None
    history: str | None = None
    agent: str | None = None  # which of a program's agents made the call (gateway), None otherwise


@dataclass(frozen=True)
class EpisodeIdentity:
    """Where an episode belongs: the ids the agent loop gives it (`<prefix><prompt_id>-s<k>` in group
    `<prefix><prompt_id>`) and the policy version that serves it unless a replica reports its own."""

    episode_id: str
    group_id: str
    prompt_id: str
    sample_idx: int
    policy_version: int


def one_step_episode(identity: EpisodeIdentity, prompt_ids: list[int], generation: Generation, response_text: str,
                     *, termination: str, info: dict[str, Any], anchor: str | None = None) -> StepRecord:
    """The only step of an episode that one generation ends (`termination`: answered, error, ...):
    a naive-RAG demonstration, a plugin driver's episode."""
    if termination not in TERMINATIONS:
        raise ValueError(f"termination {termination!r} is not one of {', '.join(TERMINATIONS)}")
    version = identity.policy_version if generation.policy_version is None else generation.policy_version
    return StepRecord(
        episode_id=identity.episode_id, group_id=identity.group_id, prompt_id=identity.prompt_id,
        sample_idx=identity.sample_idx, step_idx=0, policy_version=version, prompt_ids=list(prompt_ids),
        response_ids=list(generation.token_ids), response_logprobs=list(generation.logprobs),
        response_text=response_text, tool_calls="[]", parse_error=None, observation_text="", env_reward=0.0,
        done=True, termination=termination, truncated=termination in TRUNCATIONS,
        finish_reason=generation.finish_reason, prefix_shared=False, info=json_text(info),
        served_by=generation.served_by, retries=generation.retries, anchor=anchor, history="start",
    )


def no_action_step(identity: EpisodeIdentity, prompt_ids: list[int], *, info: dict[str, Any],
                   anchor: str | None = None) -> StepRecord:
    """The only step of an episode that failed before the policy acted (termination "error", empty
    response, finish_reason "none"; schemas/steps.py): it counts the failure and is never trained on."""
    return StepRecord(
        episode_id=identity.episode_id, group_id=identity.group_id, prompt_id=identity.prompt_id,
        sample_idx=identity.sample_idx, step_idx=0, policy_version=identity.policy_version,
        prompt_ids=list(prompt_ids), response_ids=[], response_logprobs=[], response_text="", tool_calls="[]",
        parse_error=None, observation_text="", env_reward=0.0, done=True, termination="error", truncated=False,
        finish_reason="none", prefix_shared=False, info=json_text(info), anchor=anchor, history="start",
    )


@dataclass(frozen=True)
class EpisodeFailures:
    """How many of a rollout's episodes failed (their last step's termination is "error": an agent
    program that crashed, hung or made no call, an env that raised) and their commonest reason."""

    episodes: int
    failed: int
    commonest: str = ""  # the first of the commonest reason (info["error"]), numbers aside
    commonest_count: int = 0

    @property
    def all_failed(self) -> bool:
        return self.episodes > 0 and self.failed == self.episodes

    def describe(self) -> str:
        """e.g. `20 of 20 episodes failed; 20 of them like: the program made no call to the gateway`."""
        text = f"{self.failed} of {self.episodes} episodes failed"
        return text + (f"; {self.commonest_count} of them like: {self.commonest}" if self.commonest else "")


def episode_failures(records: Sequence[StepRecord]) -> EpisodeFailures:
    """The failed episodes of `records` (EpisodeFailures); reasons that differ only in their numbers
    (a prompt's length, a time) count as one."""
    ends = [r for r in records if r.done]
    reasons = [(str(json.loads(r.info).get("error") or "no reason recorded").splitlines() or [""])[0][:300]
               for r in ends if r.termination == "error"]
    keyed = [(re.sub(r"\d+", "#", reason), reason) for reason in reasons]
    if not keyed:
        return EpisodeFailures(len(ends), 0)
    kind, count = Counter(key for key, _ in keyed).most_common(1)[0]
    return EpisodeFailures(len(ends), len(keyed), next(reason for key, reason in keyed if key == kind), count)


def storable_env_step(outcome: EnvStep) -> EnvStep:
    """`outcome` checked on the env's thread, where a problem ends one episode: found later, on the
    scheduler's thread or when the steps table is written, it would end the whole rollout.

    Lone surrogates in its text (model-written JSON escapes like "\\ud800" that an env echoes, e.g. an
    unknown tool's name) become U+FFFD: neither tokenizers nor Parquet take text UTF-8 cannot encode.
    """
    if not isinstance(outcome, EnvStep):
        raise TypeError(f"env.step returned {type(outcome).__name__}, not EnvStep")
    texts = [outcome.observation, outcome.parse_error or "", "" if outcome.anchor is None else outcome.anchor,
             *(m.content for m in outcome.observation_messages)]
    if (not all(isinstance(text, str) for text in texts) or not isinstance(outcome.info, dict)
            or not all(isinstance(call, ToolCall) for call in outcome.tool_calls)):
        raise TypeError("EnvStep observation, parse_error, anchor and message contents must be str, info a dict "
                        "and tool_calls ToolCalls")
    if not math.isfinite(outcome.reward) or (outcome.done and outcome.termination not in TERMINATIONS):
        raise ValueError(f"EnvStep reward {outcome.reward!r} is not finite, or done with termination "
                         f"{outcome.termination!r} (valid: {', '.join(TERMINATIONS)})")
    if not any(map(has_surrogates, texts)):
        return outcome
    return replace(
        outcome, observation=utf8_safe(outcome.observation),
        parse_error=None if outcome.parse_error is None else utf8_safe(outcome.parse_error),
        anchor=None if outcome.anchor is None else utf8_safe(outcome.anchor),
        observation_messages=tuple(ChatMessage(m.role, utf8_safe(m.content)) for m in outcome.observation_messages),
    )


def has_surrogates(text: str) -> bool:
    return _SURROGATES.search(text) is not None


def utf8_safe(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD.

    Model-written JSON may hold escapes like "\\ud800", which json.loads turns into lone
    surrogates; tokenizers and Parquet refuse text that UTF-8 cannot encode, so an env echoing
    them (an unknown tool's name, a parse error naming a key) must not reach either as is.
    """
    return _SURROGATES.sub("\ufffd", text)


def json_text(value: Any) -> str:
    """JSON text of `value` for the steps table's JSON columns; never raises.

    Tool calls and info hold what the model and tools produced: NaN, non-string keys, cycles and
    nesting deeper than the interpreter's stack would make json.dumps raise on the scheduler's
    thread and end the rollout. Such values are stored converted (see `_jsonable`) instead.
    """
    try:
        text = json.dumps(value, default=str, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = json.dumps(_jsonable(value, 0), ensure_ascii=False)
    return utf8_safe(text)  # surrogates only occur inside string literals, so the JSON stays valid


def _jsonable(value: Any, depth: int) -> Any:
    """`value` as plain JSON: non-finite floats, huge ints and unknown types as strings, keys as
    strings, containers nested deeper than _MAX_JSON_DEPTH (a cycle, too) as "...", sets as lists."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= _MAX_INT_BITS else f"<int of {value.bit_length()} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)) and depth >= _MAX_JSON_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {key if isinstance(key, str) else str(_jsonable(key, depth + 1)): _jsonable(item, depth + 1)
                for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(item, depth + 1) for item in value]
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - a __str__ that raises
        return f"<{type(value).__name__}>"
