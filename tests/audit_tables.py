"""Small synthetic run tables for the audit's tests, written with the project's own writer
(agent_core.io.tables.write_table: validated against the schemas like any stage's output)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.tables import write_table

QUESTION = "Question: Where was the director of Vi Fin born?"


@dataclass(frozen=True)
class Action:
    text: str = "<search>Vi Fin</search>"
    ids: tuple[int, ...] = (5, 6, 7, 8, 9)
    calls: tuple[bool, ...] = (True,)  # one entry per tool call: ok or not
    parse_error: str | None = None
    observation: str = "Vi Fin is a film directed by Gos Kin."
    answer: str | None = None  # set: the episode's final answer step
    failure: str | None = None  # set on the last action: the episode ended in this error
    cut: bool = False  # the token limit cut it (finish_reason length)


@dataclass(frozen=True)
class Episode:
    actions: tuple[Action, ...] = (Action(), Action(text="<answer>Zurport</answer>", calls=(), observation="",
                                                     answer="Zurport"))
    em: float = 1.0
    format_score: float = 1.0
    format_weight: float = 0.1
    advantage: float = 0.5  # every token of every step (0: the episode's group gave no signal)


@dataclass
class Update:
    entropy: float = 2.0
    kl: float = 0.01
    clipfrac: float = 0.05
    loss: float = 0.1
    skipped: bool = False
    skip_reason: str | None = None
    extra: dict = field(default_factory=dict)


def _step_rows(run_id: str, k: int, e: int, episode: Episode) -> list[dict]:
    rows, n = [], len(episode.actions)
    for i, a in enumerate(episode.actions):
        done = i == n - 1
        termination = ("error" if a.failure else "answered" if a.answer is not None else "max_steps") if done else None
        calls = [{"name": "search", "arguments": {"query": "x"}, "ok": ok, "error_kind": None if ok else "tool_error",
                  "latency_s": 0.0} for ok in a.calls]
        info = {"answer": a.answer, "format_ok": True} if a.answer is not None else {"num_calls": len(a.calls)}
        if a.failure:
            info["error"] = a.failure
        rows.append(dict(
            run_id=run_id, iteration=k, episode_id=f"{run_id}-i{k}-e{e}", group_id=f"{run_id}-i{k}-g{e // 2}",
            prompt_id=f"p{e // 2}", sample_idx=e % 2, step_idx=i, policy_version=k, prompt_ids=[1, 2, 3],
            response_ids=list(a.ids), response_logprobs=[-0.5] * len(a.ids), response_text=a.text,
            tool_calls=json.dumps(calls), parse_error=a.parse_error, observation_text=a.observation, env_reward=0.0,
            done=done, termination=termination, truncated=termination == "max_steps",
            finish_reason="length" if a.cut else "stop",
            prefix_shared=not done, info=json.dumps(info), served_by=None, retries=0, generated_at=1.0, anchor=None,
            history="start" if i == 0 else "appended"))
    return rows


def _reward_rows(run_id: str, k: int, e: int, episode: Episode) -> list[dict]:
    rows, n = [], len(episode.actions)
    for i in range(n):
        final = i == n - 1
        outcome = episode.em + episode.format_weight * episode.format_score if final else 0.0
        rows.append(dict(
            run_id=run_id, iteration=k, episode_id=f"{run_id}-i{k}-e{e}", group_id=f"{run_id}-i{k}-g{e // 2}",
            prompt_id=f"p{e // 2}", sample_idx=e % 2, step_idx=i, process_reward=0.0, outcome_reward=outcome,
            process_factor=1.0, reward=outcome, em=episode.em if final else None, f1=episode.em if final else None,
            format_score=episode.format_score if final else None,
            components=json.dumps({"em": episode.em, "format": episode.format_score}), scorer="qa_em"))
    return rows


def _advantage_rows(run_id: str, k: int, e: int, episode: Episode) -> list[dict]:
    return [dict(run_id=run_id, iteration=k, episode_id=f"{run_id}-i{k}-e{e}", step_idx=i,
                 advantages=[episode.advantage] * len(a.ids), returns=[episode.advantage] * len(a.ids), values=None,
                 ref_logprobs=None, obs_advantages=None, obs_returns=None, obs_values=None, estimator="grpo")
            for i, a in enumerate(episode.actions) if a.ids]


def write_iteration(root: Path, run_id: str, k: int, episodes: list[Episode], updates: list[Update] | None = None,
                    question: str = QUESTION) -> RunLayout:
    """Write iteration k's prompts, steps, rewards, advantages and train_metrics tables of run `run_id` under `root`."""
    run = DataRoot(Path(root)).run(run_id)
    prompt_ids = sorted({f"p{e // 2}" for e in range(len(episodes))})
    messages = json.dumps([{"role": "user", "content": question}])
    write_table("prompts", [dict(run_id=run_id, iteration=k, prompt_id=p, data_source="synthetic", split="train",
                                 messages=messages, ground_truth=json.dumps({"answers": ["Zurport"]}),
                                 env=json.dumps({"name": "search_qa", "kwargs": {}}), metadata="{}")
                            for p in prompt_ids], run.table_uri(k, "prompts"))
    write_table("steps", [r for e, ep in enumerate(episodes) for r in _step_rows(run_id, k, e, ep)],
                run.table_uri(k, "steps"))
    write_table("rewards", [r for e, ep in enumerate(episodes) for r in _reward_rows(run_id, k, e, ep)],
                run.table_uri(k, "rewards"))
    write_table("advantages", [r for e, ep in enumerate(episodes) for r in _advantage_rows(run_id, k, e, ep)],
                run.table_uri(k, "advantages"))
    metrics = []
    for u, up in enumerate(updates if updates is not None else [Update()]):
        nan = float("nan")
        metrics.append(dict(
            run_id=run_id, iteration=k, update_idx=u, loss=nan if up.skipped else up.loss, pg_loss=nan if up.skipped else up.loss,
            vf_loss=None, entropy=nan if up.skipped else up.entropy, kl=nan if up.skipped else up.kl,
            clipfrac=nan if up.skipped else up.clipfrac, grad_norm=nan if up.skipped else 1.0, lr=1e-3, tokens=100,
            tokens_per_s=10.0, seconds=1.0, skipped=up.skipped, skip_reason=up.skip_reason, started_at=0.0,
            finished_at=1.0, oom_splits=0, **up.extra))
    write_table("train_metrics", metrics, run.table_uri(k, "train_metrics"))
    return run


def healthy(n: int = 4) -> list[Episode]:
    return [Episode() for _ in range(n)]
