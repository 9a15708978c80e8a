"""What `agentr1 view` shows, read from the step tables (docs/guides/view-your-runs.md).

Every read goes through a read-only catalog (`open_run_catalog`, the one `agentr1 query` and the
audit use): one SELECT, only the tables' files readable. No SQL of a user's runs here: the episode
filter runs over the iteration's episode rows only, in agent_core/io/row_filter.py (issue 55: a
filter put into the run catalog's SELECT read the gold answers). Typed rows out, never DataFrames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import duckdb
import pyarrow as pa

from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.readonly_sql import QueryError, one_line, sql_string
from agent_core.io.ledger import ledger_uri
from agent_core.io.row_filter import FILTER_TIMEOUT_S, FilterError, filter_rows
from agent_core.io.run_catalog import health_uri, open_run_catalog
from agent_core.io.run_status import RunStatus, list_runs
from agent_core.io.summaries import IterationSummary, eval_scores, iteration_summary

EPISODE_COLUMNS = ("episode_id", "group_id", "prompt_id", "sample_idx", "steps", "tokens", "termination",
                   "answer", "reward", "em")
EPISODE_LIMIT = 500  # rows an iteration's table shows; the filter narrows it
_EPISODES_SQL = """
WITH ep AS (
    SELECT episode_id, any_value(group_id) AS group_id, any_value(prompt_id) AS prompt_id,
           any_value(sample_idx) AS sample_idx, count(*) AS steps, sum(len(response_ids)) AS tokens,
           max(CASE WHEN done THEN termination END) AS termination,
           max(CASE WHEN done THEN json_extract_string(info, '$.answer') END) AS answer
    FROM steps GROUP BY episode_id),
rw AS (SELECT episode_id, sum(reward) AS reward, max(em) AS em FROM rewards GROUP BY episode_id)
SELECT ep.*, rw.reward, rw.em FROM ep LEFT JOIN rw USING (episode_id)"""
_STEPS_SQL = """
SELECT s.episode_id, s.step_idx, s.prompt_ids, s.response_ids, s.response_logprobs, s.response_text, s.tool_calls,
       s.parse_error, s.observation_text, s.termination, s.finish_reason, s.history, s.agent,
       r.reward, r.process_reward, r.outcome_reward, a.advantages, a.obs_advantages
FROM steps s
LEFT JOIN rewards r USING (episode_id, step_idx)
LEFT JOIN advantages a USING (episode_id, step_idx)
WHERE {where} ORDER BY s.episode_id, s.step_idx"""


@dataclass(frozen=True)
class RunOverview:
    status: RunStatus
    dev_em: tuple[float, ...]  # per done iteration (nan: not evaluated), for the sparkline
    alerts: int | None = None  # health checks in alert, over every iteration (None: no health table read)
    wall_seconds: float | None = None  # the ledger's stages, summed (None: no ledger read)
    cost: float | None = None  # device hours x price_per_hour, where a price was set (None: no price)
    currency: str = ""


@dataclass(frozen=True)
class EpisodeRow:
    episode_id: str
    group_id: str
    prompt_id: str
    sample_idx: int
    steps: int
    tokens: int
    termination: str | None
    answer: str | None  # the final answer, when the episode ended with one
    reward: float | None
    em: float | None


@dataclass(frozen=True)
class Token:
    text: str
    token_id: int
    logprob: float
    advantage: float | None  # None: not trained (no advantages row, e.g. a failed episode left out)

    @property
    def trained(self) -> bool:
        return self.advantage is not None


@dataclass(frozen=True)
class StepView:
    step_idx: int
    context: str  # the prompt the policy saw at this step, decoded
    action: tuple[Token, ...]
    response_text: str
    tool_calls: str
    parse_error: str | None
    observation: str
    observation_trained: bool  # the observation's tokens carry advantages (the loss mask's ablation)
    termination: str | None
    finish_reason: str
    history: str | None
    agent: str | None
    reward: float | None
    process_reward: float | None
    outcome_reward: float | None


class ViewError(Exception):
    """A page's data could not be read: one line naming the table or the refused SQL."""


def runs_overview(root: DataRoot) -> tuple[list[RunOverview], list[str]]:
    """Every run with its dev EM per iteration; problems as `agentr1 runs` reports them."""
    statuses, problems = list_runs(root)
    iterations = {status.run_id: root.run(status.run_id).iterations() for status in statuses}
    files = {(run_id, k): root.run(run_id).dev_eval_uri(k) for run_id, done in iterations.items() for k in done}
    em = _dev_ems({key: uri for key, uri in files.items() if Path(uri).is_file()})
    alerts = _per_run(root, iterations, health_uri, "count(*) FILTER (WHERE status = 'alert')")
    costs = _per_run(root, iterations, ledger_uri, "sum(wall_seconds), sum(device_seconds / 3600 * price_per_hour), "
                     "any_value(currency) FILTER (WHERE price_per_hour IS NOT NULL)")
    out = []
    for status in statuses:
        wall, cost, currency = costs.get(status.run_id, (None, None, None))
        out.append(RunOverview(status, tuple(em.get((status.run_id, k), math.nan) for k in iterations[status.run_id]),
                               alerts=(alerts.get(status.run_id) or (None,))[0], wall_seconds=wall, cost=cost,
                               currency=currency or ""))
    return out, problems


def _per_run(root: DataRoot, iterations: dict[str, list[int]], table_uri: Callable[[RunLayout, int], str],
             aggregates: str) -> dict[str, tuple]:
    """`aggregates` of one table over every iteration of each run, in one query; {} for the runs
    with no such file, and for all of them when a file is damaged (the runs page still lists them)."""
    run_of = {}
    for run_id, done in iterations.items():
        for k in {0, *done}:
            uri = Path(table_uri(root.run(run_id), k))
            if uri.is_file():
                run_of[str(uri)] = run_id
    if not run_of:
        return {}
    files = list(run_of)
    try:
        with duckdb.connect() as con:
            rows = con.execute(f"SELECT r.run_id, {aggregates} FROM read_parquet(?, filename = true, union_by_name = "
                               "true) JOIN (SELECT unnest(?) AS filename, unnest(?) AS run_id) AS r USING (filename) "
                               "GROUP BY r.run_id", [files, files, [run_of[f] for f in files]]).fetchall()
    except (duckdb.Error, OSError):
        return {}
    return {run_id: tuple(values) for run_id, *values in rows}


def _dev_ems(files: dict[tuple[str, int], str]) -> dict[tuple[str, int], float]:
    """Mean dev EM of each file: one query over all of them (one per file took 20 s for 50 runs of 12
    iterations), or file by file when one is damaged (that one is left out: nan)."""
    if not files:
        return {}
    key_of = {str(Path(uri)): key for key, uri in files.items()}
    try:
        with duckdb.connect() as con:
            rows = con.execute("SELECT filename, avg(em) FROM read_parquet(?, filename = true) GROUP BY filename",
                               [list(key_of)]).fetchall()
        return {key_of[name]: math.nan if em is None else float(em) for name, em in rows}
    except (duckdb.Error, OSError):
        out = {}
        for key, uri in files.items():
            try:
                out[key] = eval_scores(uri)[0]
            except (duckdb.Error, OSError, ValueError, TypeError):
                out[key] = math.nan
        return out


def run_iterations(run: RunLayout) -> list[IterationSummary]:
    """The run's iterations that have their tables (ViewError naming the first unreadable one)."""
    out = []
    for k in run.iterations():
        try:
            out.append(iteration_summary(run, k))
        except (duckdb.Error, OSError, ValueError, TypeError) as error:
            if not Path(run.table_uri(k, "train_metrics")).exists():
                break  # the iteration in progress
            raise ViewError(f"iteration {k} of {run.run_id}: {one_line(error)}") from None
    return out


def run_table_rows(run: RunLayout, table: str, order: str) -> list[dict[str, Any]]:
    """Every row of one of the run's tables (health, ledger), ordered."""
    return _select(run, None, f"SELECT * FROM {table} ORDER BY {order}")


def iteration_episodes(run: RunLayout, iteration: int, where: str = "", order_by: str = "episode_id",
                       descending: bool = False, timeout: float = FILTER_TIMEOUT_S) -> list[EpisodeRow]:
    """The iteration's first EPISODE_LIMIT episodes (EPISODE_COLUMNS) in order, filtered by a user's
    `where` clause over those rows only (row_filter.py, within `timeout` seconds); ViewError saying
    why not, quoting no data."""
    if order_by not in EPISODE_COLUMNS:
        raise ViewError(f"cannot sort by {order_by!r}; columns: {', '.join(EPISODE_COLUMNS)}")
    order = f"ORDER BY {order_by} {'DESC' if descending else 'ASC'} NULLS LAST, episode_id LIMIT {EPISODE_LIMIT}"
    if not where.strip():
        return _episodes(run, iteration, "TRUE", order)
    try:  # never into the run catalog's SELECT: there a subquery read `prompts` (issue 55)
        rows = filter_rows(_table(run, [iteration], _EPISODES_SQL), where, order, timeout)
    except FilterError as error:
        raise ViewError(str(error)) from None
    return [EpisodeRow(**row) for row in rows.to_pylist()]


def prompt_episodes(run: RunLayout, iteration: int, prompt_id: str) -> list[EpisodeRow]:
    """One prompt's episodes in one iteration (a group's samples), for the compare page."""
    return _episodes(run, iteration, f"prompt_id = {sql_string(prompt_id)}",
                     f"ORDER BY sample_idx, episode_id LIMIT {EPISODE_LIMIT}")


def _episodes(run: RunLayout, iteration: int, where: str, order: str) -> list[EpisodeRow]:
    """Episodes by our own `where` (a user's goes through row_filter.py: see iteration_episodes)."""
    sql = f"SELECT * FROM ({_EPISODES_SQL}) AS episodes WHERE {where} {order}"
    return [EpisodeRow(**row) for row in _select(run, [iteration], sql)]


def episode_steps(run: RunLayout, iteration: int, episode_id: str, tokenizer) -> list[StepView]:
    """One episode's steps with their tokens, log-probs and advantages; ViewError when it has none."""
    rows = _select(run, [iteration], _STEPS_SQL.format(where=f"s.episode_id = {sql_string(episode_id)}"))
    if not rows:
        raise ViewError(f"no episode {episode_id!r} in iteration {iteration} of {run.run_id}")
    return [_step_view(row, tokenizer) for row in rows]


@dataclass(frozen=True)
class StepText:
    """A step as text (an MLflow trace's span): no tokens, so no tokenizer to read it."""

    step_idx: int
    response_text: str
    tool_calls: str
    parse_error: str | None
    observation: str
    termination: str | None
    tokens: int
    mean_logprob: float | None
    mean_advantage: float | None  # over the action's tokens; None: not trained
    reward: float | None
    process_reward: float | None
    outcome_reward: float | None


def episodes_as_text(run: RunLayout, iteration: int, episode_ids: list[str]) -> dict[str, list[StepText]]:
    """The steps of `episode_ids` in one iteration, in order, in one query."""
    if not episode_ids:
        return {}
    sql = _STEPS_SQL.format(where=f"s.episode_id IN ({', '.join(sql_string(e) for e in episode_ids)})")
    out: dict[str, list[StepText]] = {}
    for row in _select(run, [iteration], sql):
        ids_, logprobs, advantages = row["response_ids"], row["response_logprobs"], row["advantages"]
        out.setdefault(row["episode_id"], []).append(StepText(
            row["step_idx"], row["response_text"], row["tool_calls"], row["parse_error"], row["observation_text"],
            row["termination"], len(ids_), sum(logprobs) / len(logprobs) if logprobs else None,
            sum(advantages) / len(advantages) if advantages else None, row["reward"], row["process_reward"],
            row["outcome_reward"]))
    return out


def _step_view(row: dict[str, Any], tokenizer) -> StepView:
    advantages = row["advantages"]
    ids, logprobs = row["response_ids"], row["response_logprobs"]
    action = tuple(Token(tokenizer.decode([i]), i, lp, None if advantages is None else advantages[k])
                   for k, (i, lp) in enumerate(zip(ids, logprobs)))
    return StepView(row["step_idx"], tokenizer.decode(row["prompt_ids"]), action, row["response_text"],
                    row["tool_calls"], row["parse_error"], row["observation_text"],
                    row["obs_advantages"] is not None, row["termination"], row["finish_reason"], row["history"],
                    row["agent"], row["reward"], row["process_reward"], row["outcome_reward"])


def episode_sql(run_id: str, iteration: int, episode_id: str) -> str:
    """The `agentr1 query` that shows the episode's steps as this page does."""
    return (f"SELECT s.step_idx, s.response_text, s.observation_text, r.reward, a.advantages FROM steps s "
            f"LEFT JOIN rewards r USING (run_id, iteration, episode_id, step_idx) "
            f"LEFT JOIN advantages a USING (run_id, iteration, episode_id, step_idx) "
            f"WHERE s.run_id = {sql_string(run_id)} AND s.iteration = {iteration} AND s.episode_id = {sql_string(episode_id)} "
            f"ORDER BY s.step_idx")


def _select(run: RunLayout, iterations: list[int] | None, sql: str) -> list[dict[str, Any]]:
    return _table(run, iterations, sql).to_pylist()


def _table(run: RunLayout, iterations: list[int] | None, sql: str) -> pa.Table:
    try:
        with open_run_catalog(run, iterations) as catalog:
            return catalog.select(sql)
    except QueryError as error:
        raise ViewError(str(error)) from None
