"""The cost ledger: what each stage of a run took, and the views that price it (issue 33, README
"What a run cost").

Nothing is measured twice. Each stage's wall seconds are what its manifest already records
(`StageRecord` times every stage from its record to its commit; rollout and train give their own
span, train's being `train_metrics.finished_at - started_at`); `ledger_rows` copies them, with
the device the run held and the run's price, into the `ledger` table of the iteration
(schemas/ledger.py). Per-step seconds and tokens stay where the agent loop wrote them (the steps
table: `info.generate_seconds` / `queue_seconds` / `env_seconds`, each tool call's `latency_s`,
the token id lists): the `step_costs` view exposes them as columns. The `costs` view sums a run's
ledger, prices it and sets its last dev EM beside it: EM per device-hour, and per unit of money
when a price is set (null when not: an unknown cost is not zero).

Derived views are SQL over the table views (`DERIVED_VIEWS`); agent_core/io/query.py adds each
to the read-only catalog when the views it reads exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent_core.config.cost import CostConfig
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import read_manifest
from agent_core.io.tables import read_table, table_exists

LEDGER_TABLE = "ledger"
ITERATION_STAGES = (
    "prepare_data", "rollout", "label_rewards", "compute_advantages", "train", "dev_eval", "log_iteration", "audit",
    "prune")
# Stages of the run as a whole, booked to iteration 0 (the start policy's dev_eval under its own name).
RUN_STAGES = (("init_policy", "init_policy"), ("init_critic", "init_critic"),
              ("oracle_episodes", "oracle_episodes"), ("warm_start", "warm_start"), ("dev_eval", "dev_eval_start"))


@dataclass(frozen=True)
class DeviceUse:
    """Where a run's models lived and how many such devices it held ("cuda" GPUs or "cpu" cores)."""

    kind: str
    count: int


@dataclass(frozen=True)
class LedgerRow:
    stage: str
    algorithm: str
    device: str
    device_count: int
    wall_seconds: float
    device_seconds: float
    price_per_hour: float | None
    currency: str


def ledger_uri(run: RunLayout, iteration: int) -> str:
    """`runs/<run_id>/iteration=<k>/ledger.parquet` (beside the run tables; the catalog's `ledger` view)."""
    return str(run.iteration_dir(iteration) / f"{LEDGER_TABLE}.parquet")


def _stage_paths(run: RunLayout, iteration: int) -> list[tuple[str, Path]]:
    paths = [(stage, run.manifest_path(stage, iteration)) for stage in ITERATION_STAGES]
    if iteration == 0:
        paths += [(name, run.manifest_path(stage)) for stage, name in RUN_STAGES]
    return paths


def stage_seconds(run: RunLayout, iteration: int) -> list[tuple[str, float]]:
    """(stage, seconds) for each stage of `iteration` with a committed manifest that holds its seconds
    (a stage that did not run, e.g. dev_eval between evaluations, has none)."""
    found = []
    for stage, path in _stage_paths(run, iteration):
        manifest = read_manifest(path)
        seconds = None if manifest is None else manifest.metrics.get("seconds")
        if stage == "train":  # its manifest may still be queued behind a background save (tasks/train.py)
            seconds = _train_span(run, iteration, seconds)
        if seconds is not None:
            found.append((stage, seconds))
    return found


def recorded_seconds(run: RunLayout, iterations: int) -> float:
    """What the stages of iterations 0..iterations-1 (and the run's own, booked to 0) took when they
    ran: the same after a resume that skipped them. Overlapping stages (runtime.max_staleness) both count."""
    return sum(seconds for k in range(max(iterations, 1)) for _, seconds in stage_seconds(run, k))


def ledger_rows(run: RunLayout, iteration: int, algorithm: str, device: DeviceUse, cost: CostConfig) -> list[LedgerRow]:
    """One row per stage of `iteration` that recorded its seconds (`stage_seconds`)."""
    price = cost.price_per_hour(device.kind)
    return [LedgerRow(stage, algorithm, device.kind, device.count, seconds, seconds * device.count, price,
                      cost.currency) for stage, seconds in stage_seconds(run, iteration)]


def _train_span(run: RunLayout, iteration: int, recorded: float | None) -> float | None:
    """The train stage's seconds as `train_metrics` records them (the same span its manifest gets)."""
    uri = run.table_uri(iteration, "train_metrics")
    if not table_exists(uri):
        return recorded
    table = read_table("train_metrics", uri)
    if table.num_rows == 0:
        return recorded
    return table["finished_at"][0].as_py() - table["started_at"][0].as_py()


# ---- derived views --------------------------------------------------------------------------------

STEP_COSTS_SQL = """
SELECT run_id, iteration, episode_id, step_idx,
       len(prompt_ids) AS tokens_in, len(response_ids) AS tokens_out,
       TRY_CAST(json_extract_string(info, '$.generate_seconds') AS DOUBLE) AS generate_seconds,
       TRY_CAST(json_extract_string(info, '$.queue_seconds') AS DOUBLE) AS queue_seconds,
       TRY_CAST(json_extract_string(info, '$.env_seconds') AS DOUBLE) AS env_seconds,
       json_array_length(tool_calls) AS tool_calls,
       TRY_CAST(json_extract(tool_calls, '$[*].latency_s') AS DOUBLE[]) AS tool_call_seconds,
       coalesce(list_sum(TRY_CAST(json_extract(tool_calls, '$[*].latency_s') AS DOUBLE[])), 0) AS tool_seconds
FROM steps
"""

# dev_eval's eval_id is `<run_id>-dev-<k>` (tasks/evaluate.py); `start` (the policy RL started from) is left out.
_DEV_EM_SQL = """
SELECT regexp_extract(eval_id, '^(.*)-dev-([0-9]+)$', 1) AS run_id,
       TRY_CAST(regexp_extract(eval_id, '^(.*)-dev-([0-9]+)$', 2) AS INTEGER) AS iteration, avg(em) AS em
FROM dev_eval WHERE regexp_matches(eval_id, '-dev-[0-9]+$') GROUP BY ALL
"""
_NO_DEV_EM_SQL = "SELECT NULL::VARCHAR AS run_id, NULL::INTEGER AS iteration, NULL::DOUBLE AS em WHERE false"


def costs_sql(with_dev_eval: bool) -> str:
    """One row per run (and algorithm, device, currency): its hours, tokens, cost, last dev EM and EM
    per device-hour / per unit of cost. cost is null unless every ledger row of the run has a price."""
    return f"""
WITH spend AS (
    SELECT run_id, algorithm, device, currency, count(DISTINCT iteration) AS iterations,
           sum(wall_seconds) / 3600 AS wall_hours, sum(device_seconds) / 3600 AS device_hours,
           CASE WHEN count(price_per_hour) = count(*) THEN sum(device_seconds / 3600 * price_per_hour) END AS cost
    FROM ledger GROUP BY ALL),
tokens AS (SELECT run_id, sum(tokens_in) AS tokens_in, sum(tokens_out) AS tokens_out FROM step_costs GROUP BY run_id),
dev AS ({_DEV_EM_SQL if with_dev_eval else _NO_DEV_EM_SQL}),
last_dev AS (SELECT run_id, arg_max(em, iteration) AS dev_em FROM dev WHERE iteration IS NOT NULL GROUP BY run_id)
SELECT spend.*, tokens.tokens_in, tokens.tokens_out, last_dev.dev_em,
       last_dev.dev_em / nullif(spend.device_hours, 0) AS em_per_device_hour,
       last_dev.dev_em / nullif(spend.cost, 0) AS em_per_cost
FROM spend LEFT JOIN tokens USING (run_id) LEFT JOIN last_dev USING (run_id)
"""


def derived_views(views: set[str]) -> list[tuple[str, str]]:
    """(name, SELECT) of each derived view whose inputs are among `views`, in creation order."""
    derived = []
    if "steps" in views:
        derived.append(("step_costs", STEP_COSTS_SQL))
        if LEDGER_TABLE in views:
            derived.append(("costs", costs_sql("dev_eval" in views)))
    return derived
