"""Sampled episodes as MLflow traces (`tracking.traces`), for users who live in MLflow's UI: one trace
per episode in the run's MLflow run, one span per step (its action as input, its tool calls and
observation as output; reward, advantage, log-prob and token count as attributes). The episodes
are spread over the iteration's rewards, worst to best, so a few show what the policy did well and badly.

MLflow exports spans through a process-wide tracer bound to the global tracking URI, in a background
queue: `_exporting_to` points it at the run's store and exports synchronously, for the block only.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

import mlflow
import mlflow.tracing

from agent_core.io.layout import RunLayout
from agent_core.io.trace_view import EpisodeRow, StepText, episodes_as_text, iteration_episodes
from agent_core.io.tracking import Tracker


def spread(episodes: list[EpisodeRow], count: int) -> list[EpisodeRow]:
    """`count` of `episodes` evenly spaced by reward (then episode id), the lowest and highest included."""
    ranked = sorted(episodes, key=lambda e: (e.reward if e.reward is not None else float("-inf"), e.episode_id))
    if count >= len(ranked):
        return ranked
    if count == 1:
        return [ranked[-1]]
    return [ranked[round(i * (len(ranked) - 1) / (count - 1))] for i in range(count)]


def log_episode_traces(tracker: Tracker, mlflow_run_id: str, run: RunLayout, iteration: int, count: int) -> int:
    """Log `count` of the iteration's episodes as traces of `mlflow_run_id`; returns how many."""
    chosen = spread(iteration_episodes(run, iteration), count)
    steps = episodes_as_text(run, iteration, [e.episode_id for e in chosen])
    with _exporting_to(tracker.tracking_uri):
        for episode in chosen:
            _log_episode(tracker, mlflow_run_id, run.run_id, iteration, episode, steps.get(episode.episode_id, []))
    return len(chosen)


_EXPORT_LOCK = threading.Lock()  # the tracer is process-wide: one run's block at a time
_ASYNC = "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"


@contextmanager
def _exporting_to(tracking_uri: str) -> Iterator[None]:
    with _EXPORT_LOCK:
        previous_uri, previous_async = mlflow.get_tracking_uri(), os.environ.get(_ASYNC)
        os.environ[_ASYNC] = "false"
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.tracing.reset()  # the tracer binds its exporter to the tracking URI when built
        try:
            yield
        finally:
            if previous_async is None:
                os.environ.pop(_ASYNC, None)
            else:
                os.environ[_ASYNC] = previous_async
            mlflow.set_tracking_uri(previous_uri)
            mlflow.tracing.reset()


def _log_episode(tracker: Tracker, mlflow_run_id: str, run_id: str, iteration: int, episode: EpisodeRow,
                 steps: list[StepText]) -> None:
    client = tracker.client
    attributes = {"run_id": run_id, "iteration": iteration, "episode_id": episode.episode_id,
                  "prompt_id": episode.prompt_id, "group_id": episode.group_id, "reward": episode.reward,
                  "em": episode.em, "steps": episode.steps, "termination": episode.termination}
    root = client.start_trace(f"episode {episode.episode_id}", span_type="AGENT", run_id=mlflow_run_id,
                              experiment_id=tracker.experiment_id, inputs={"prompt_id": episode.prompt_id},
                              attributes={k: v for k, v in attributes.items() if v is not None})
    for step in steps:
        span = client.start_span(f"step {step.step_idx}", trace_id=root.trace_id, parent_id=root.span_id,
                                 span_type="LLM", inputs={"action": step.response_text},
                                 attributes=_step_attributes(step))
        client.end_span(root.trace_id, span.span_id,
                        outputs={"tool_calls": step.tool_calls, "observation": step.observation,
                                 "parse_error": step.parse_error},
                        status="ERROR" if step.termination == "error" else "OK")
    client.end_trace(root.trace_id, outputs={"answer": episode.answer, "em": episode.em})


def _step_attributes(step: StepText) -> dict[str, float | int | str]:
    values = {"reward": step.reward, "process_reward": step.process_reward, "outcome_reward": step.outcome_reward,
              "advantage": step.mean_advantage, "mean_logprob": step.mean_logprob, "tokens": step.tokens,
              "trained": step.mean_advantage is not None, "termination": step.termination}
    return {k: v for k, v in values.items() if v is not None}
