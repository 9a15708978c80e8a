"""Per-iteration summary metrics, computed with DuckDB straight from the iteration's tables."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb

from agent_core.io.layout import RunLayout


@dataclass(frozen=True)
class IterationSummary:
    iteration: int
    episodes: int
    failed_episodes: int  # ended in an error (termination "error"): left out of training by default
    mean_reward: float  # mean over episodes of the episode's summed reward (the combined reward trained on)
    em: float
    f1: float
    format_score: float
    steps_per_episode: float
    tool_calls_per_episode: float  # tool calls made (ok or not), per episode
    generated_tokens: int
    loss: float
    pg_loss: float
    value_loss: float  # nan without a critic
    kl: float
    entropy: float
    clipfrac: float
    grad_norm: float
    train_tokens_per_s: float
    skipped_updates: int
    dev_em: float  # held-out EM after the iteration (DevEvalConfig); nan when not evaluated
    dev_f1: float

    def metrics(self) -> dict[str, float]:
        """Everything numeric except the iteration, for MLflow."""
        return {k: float(v) for k, v in asdict(self).items() if k != "iteration"}


_EPISODES_SQL = """
with episodes as (
    select episode_id, sum(reward) as ret, max(em) as em, max(f1) as f1, max(format_score) as fmt,
           count(*) as steps
    from read_parquet(?) group by episode_id
)
select count(*), avg(ret), avg(em), avg(f1), avg(fmt), avg(steps) from episodes
"""
_STEPS_SQL = """
select coalesce(sum(len(response_ids)), 0), coalesce(sum(json_array_length(tool_calls)), 0),
       count(*) filter (where done and termination = 'error')
from read_parquet(?)
"""
_TRAIN_SQL = """
select avg(loss), avg(pg_loss), avg(vf_loss), avg(kl), avg(entropy), avg(clipfrac), avg(grad_norm),
       avg(tokens_per_s), count(*) filter (where skipped)
from read_parquet(?)
"""


def eval_scores(uri: str, con: duckdb.DuckDBPyConnection | None = None) -> tuple[float, float]:
    """(mean EM, mean F1) of an `eval` table; (nan, nan) when it does not exist. `con`: a connection to
    reuse (opening one costs more than the query: ~40 ms)."""
    if not Path(uri).is_file():
        return math.nan, math.nan
    if con is None:
        with duckdb.connect() as own:
            return eval_scores(uri, own)
    em, f1 = con.execute("select avg(em), avg(f1) from read_parquet(?)", [uri]).fetchall()[0]
    return float(em), float(f1)


def episode_rewards(rewards_uri: str) -> tuple[int, float]:
    """(episodes, mean over episodes of the summed `reward`) of a rewards table, as the summary logs it."""
    with duckdb.connect() as con:
        count, reward, *_ = con.execute(_EPISODES_SQL, [rewards_uri]).fetchall()[0]
    return int(count), float(reward or 0.0)


def iteration_summary(run: RunLayout, iteration: int) -> IterationSummary:
    with duckdb.connect() as con:
        episodes = con.execute(_EPISODES_SQL, [run.table_uri(iteration, "rewards")]).fetchall()[0]
        generated, tool_calls, failed = con.execute(_STEPS_SQL, [run.table_uri(iteration, "steps")]).fetchall()[0]
        train = con.execute(_TRAIN_SQL, [run.table_uri(iteration, "train_metrics")]).fetchall()[0]
    dev_em, dev_f1 = eval_scores(run.dev_eval_uri(iteration))
    count, reward, em, f1, fmt, steps = episodes
    loss, pg_loss, value_loss, kl, entropy, clipfrac, grad_norm, tokens_per_s, skipped = train
    return IterationSummary(
        iteration=iteration, episodes=int(count), failed_episodes=int(failed), mean_reward=float(reward or 0.0), em=float(em or 0.0),
        f1=float(f1 or 0.0), format_score=float(fmt or 0.0), steps_per_episode=float(steps or 0.0),
        tool_calls_per_episode=float(tool_calls) / count if count else 0.0, generated_tokens=int(generated), loss=float(loss), pg_loss=float(pg_loss),
        value_loss=float("nan") if value_loss is None else float(value_loss), kl=float(kl),
        entropy=float(entropy), clipfrac=float(clipfrac), grad_norm=float(grad_norm),
        train_tokens_per_s=float(tokens_per_s), skipped_updates=int(skipped), dev_em=dev_em, dev_f1=dev_f1,
    )
