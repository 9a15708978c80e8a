"""One row of the `steps` table as a typed container (one LLM call + the env's answer)."""

from __future__ import annotations

from dataclasses import dataclass


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
