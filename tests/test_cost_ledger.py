"""The cost ledger (issue 33, item 4): a tiny 2-iteration run with a CPU price set, then the ledger
against the timings the stages already record, the per-step view against the steps table, the
`costs` view with and without prices, and the README's cost query on that run's output."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from agent_core.config import ConfigError
from agent_core.io.layout import DataRoot
from agent_core.io.ledger import ITERATION_STAGES, STEP_COSTS_SQL, ledger_uri, recorded_seconds
from agent_core.io.manifests import read_manifest
from agent_core.io.query import QueryError, run_query
from agent_core.io.readonly_sql import ReadOnlyCatalog, TableFile
from agent_core.io.tables import read_table, write_table
from agent_core.validation import load_config
from flows.train import train
from tasks.ledger import record_ledger

REPO_ROOT = Path(__file__).resolve().parent.parent
PRICE = 0.05  # per CPU-core hour
RUN_ID = "cost"


@pytest.fixture(scope="module")
def priced_run(tmp_path_factory):
    data_root = tmp_path_factory.mktemp("data")
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml",
                         [f"data_root={data_root}", f"run_id={RUN_ID}", f"cost.per_cpu_hour={PRICE}", "device=cpu"])
    train(config)
    return config, DataRoot(data_root)


def _ledger(root: DataRoot, k: int) -> dict[str, dict]:
    rows = read_table("ledger", ledger_uri(root.run(RUN_ID), k)).to_pylist()
    return {row["stage"]: row for row in rows}


@pytest.mark.slow  # trains the tiny run once per module (~40 s on 2 cores)
def test_the_ledger_books_every_stage_with_the_seconds_it_recorded(priced_run):
    config, root = priced_run
    run = root.run(RUN_ID)
    for k in range(config.iterations):
        ledger = _ledger(root, k)
        assert set(ITERATION_STAGES) <= set(ledger), k  # the tiny config evaluates after every iteration
        train_metrics = read_table("train_metrics", run.table_uri(k, "train_metrics"))
        span = train_metrics["finished_at"][0].as_py() - train_metrics["started_at"][0].as_py()
        assert ledger["train"]["wall_seconds"] == pytest.approx(span, abs=1e-6)
        rollout = read_manifest(run.manifest_path("rollout", k))
        assert ledger["rollout"]["wall_seconds"] == pytest.approx(rollout.metrics["seconds"], abs=1e-6)
        for stage, row in ledger.items():
            assert row["wall_seconds"] > 0, stage
            assert row["device"] == "cpu" and row["device_count"] >= 1
            assert row["device_seconds"] == pytest.approx(row["wall_seconds"] * row["device_count"])
            assert row["price_per_hour"] == PRICE and row["algorithm"] == config.algorithm.estimator
    assert {"init_policy", "dev_eval_start"} <= set(_ledger(root, 0))  # the run's own stages: iteration 0's
    assert "init_policy" not in _ledger(root, 1)


@pytest.mark.slow  # trains the tiny run once per module (~40 s on 2 cores)
def test_the_ledger_view_sums_to_the_recorded_stage_timings(priced_run):
    config, root = priced_run
    run = root.run(RUN_ID)
    recorded = sum(read_manifest(run.manifest_path(stage, k)).metrics["seconds"]
                   for k in range(config.iterations) for stage in ITERATION_STAGES)
    recorded += sum(read_manifest(run.manifest_path(stage)).metrics["seconds"] for stage in ("init_policy", "dev_eval"))
    total = run_query(root.path, "select sum(wall_seconds) as s from ledger").column("s")[0].as_py()
    assert total == pytest.approx(recorded, abs=1e-5)
    assert recorded_seconds(run, config.iterations) == pytest.approx(total, abs=1e-5)  # flows/seeds.py's run time
    assert recorded_seconds(run, 1) < total  # it sums only the iterations asked for


@pytest.mark.slow  # trains the tiny run once per module (~40 s on 2 cores)
def test_step_costs_carry_each_steps_tokens_and_seconds(priced_run):
    _, root = priced_run
    steps = run_query(root.path, "select episode_id, step_idx, prompt_ids, response_ids, info, tool_calls from steps "
                                 "order by episode_id, step_idx").to_pylist()
    costs = run_query(root.path, "select * from step_costs order by episode_id, step_idx").to_pylist()
    assert len(costs) == len(steps) > 0
    for step, cost in zip(steps, costs):
        info, calls = json.loads(step["info"]), json.loads(step["tool_calls"])
        assert (cost["tokens_in"], cost["tokens_out"]) == (len(step["prompt_ids"]), len(step["response_ids"]))
        assert cost["generate_seconds"] == pytest.approx(info["generate_seconds"])
        assert cost["env_seconds"] == pytest.approx(info["env_seconds"])
        assert cost["tool_calls"] == len(calls)
        assert cost["tool_call_seconds"] == pytest.approx([c["latency_s"] for c in calls])
        assert cost["tool_seconds"] == pytest.approx(sum(c["latency_s"] for c in calls))


@pytest.mark.slow  # trains the tiny run once per module (~40 s on 2 cores)
def test_the_costs_view_prices_device_hours_and_gives_em_per_device_hour(priced_run):
    config, root = priced_run
    run = root.run(RUN_ID)
    (row,) = run_query(root.path, "select * from costs").to_pylist()
    ledger = [r for k in range(config.iterations) for r in _ledger(root, k).values()]
    device_hours = sum(r["device_seconds"] for r in ledger) / 3600
    assert row["run_id"] == RUN_ID and row["algorithm"] == config.algorithm.estimator and row["device"] == "cpu"
    assert row["iterations"] == config.iterations
    assert row["device_hours"] == pytest.approx(device_hours)
    assert row["cost"] == pytest.approx(device_hours * PRICE)
    last_dev = read_table("eval", run.dev_eval_uri(config.iterations - 1))
    dev_em = pc.mean(last_dev["em"]).as_py()
    assert row["dev_em"] == pytest.approx(dev_em)
    assert row["em_per_device_hour"] == pytest.approx(dev_em / device_hours)
    assert row["em_per_cost"] == (None if row["cost"] == 0 else pytest.approx(dev_em / (device_hours * PRICE)))
    steps = read_table("steps", run.table_uri(0, "steps"))
    assert row["tokens_out"] >= sum(len(ids) for ids in steps["response_ids"].to_pylist())


@pytest.mark.slow  # trains the tiny run once per module (~40 s on 2 cores)
def test_without_a_price_the_cost_is_null_not_zero(priced_run, tmp_path):
    config, root = priced_run
    copy = DataRoot(tmp_path / "data")
    shutil.copytree(root.run(RUN_ID).run_dir, copy.run(RUN_ID).run_dir)
    unpriced = config.model_copy(update={"data_root": str(copy.path), "cost": type(config.cost)()})
    for k in range(config.iterations):
        record_ledger.fn(copy.run(RUN_ID), k, unpriced)
    (row,) = run_query(copy.path, "select * from costs").to_pylist()
    assert row["cost"] is None and row["em_per_cost"] is None
    assert row["device_hours"] > 0 and row["em_per_device_hour"] is not None
    prices = run_query(copy.path, "select count(price_per_hour) as priced, count(*) as n from ledger").to_pylist()
    assert prices == [{"priced": 0, "n": prices[0]["n"]}] and prices[0]["n"] > 0


@pytest.mark.slow  # trains the tiny run once per module (~40 s on 2 cores)
def test_the_readme_cost_query_runs_on_a_finished_run(priced_run):
    _, root = priced_run
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## What a run cost", 1)[1].split("\n## ", 1)[0]
    (query,) = re.findall(r'agentr1 query "([^"]+)"', section)
    (row,) = run_query(root.path, query).to_pylist()
    assert row["runs"] == 1 and row["device"] == "cpu"
    assert row["cost"] > 0 and row["em_per_device_hour"] is not None


def test_step_costs_read_each_tool_calls_seconds(tmp_path):
    """The tiny untrained policy seldom calls a tool: the tool-call columns on steps that do."""
    calls = [{"name": "search", "arguments": {}, "ok": True, "error_kind": None, "latency_s": 0.25},
             {"name": "search", "arguments": {}, "ok": False, "error_kind": "timeout", "latency_s": 1.5}]
    rows = [{"run_id": "r", "iteration": 0, "episode_id": "e", "step_idx": i, "prompt_ids": [1, 2, 3][: i + 1],
             "response_ids": [4] * (i + 2), "info": json.dumps({"generate_seconds": 0.5 * i, "env_seconds": 0.1}),
             "tool_calls": json.dumps(calls[:i])} for i in range(3)]
    path = tmp_path / "steps.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with ReadOnlyCatalog({"steps": [TableFile(path, path)]}) as catalog:
        catalog.add_view("step_costs", STEP_COSTS_SQL)
        got = catalog.select("select * from step_costs order by step_idx").to_pylist()
    assert [r["tool_calls"] for r in got] == [0, 1, 2]
    assert [r["tool_call_seconds"] for r in got] == [[], [0.25], [0.25, 1.5]]
    assert [r["tool_seconds"] for r in got] == [0, 0.25, 1.75]
    assert [(r["tokens_in"], r["tokens_out"]) for r in got] == [(1, 2), (2, 3), (3, 4)]
    assert [r["generate_seconds"] for r in got] == [0.0, 0.5, 1.0] and got[0]["queue_seconds"] is None


def test_the_costs_view_is_empty_before_any_ledger_and_answers_without_dev_eval(tmp_path):
    assert run_query(tmp_path, "select * from costs").num_rows == 0
    assert "em_per_device_hour" in run_query(tmp_path, "select * from costs").column_names


def test_a_damaged_steps_table_fails_only_the_queries_over_it(tmp_path):
    run = DataRoot(tmp_path).run("r")
    row = {"run_id": "r", "iteration": 0, "stage": "rollout", "algorithm": "grpo", "device": "cpu", "device_count": 2,
           "wall_seconds": 1.5, "device_seconds": 3.0, "price_per_hour": None, "currency": "USD"}
    write_table("ledger", [row], ledger_uri(run, 0))
    Path(run.table_uri(0, "steps")).write_bytes(b"not parquet at all")
    assert run_query(tmp_path, "select sum(device_seconds) as s from ledger").column("s").to_pylist() == [3.0]
    with pytest.raises(QueryError, match="steps.parquet"):
        run_query(tmp_path, "select * from costs")


@pytest.mark.parametrize("override, words", [
    ("cost.per_gpu_hour=-1", "cost.per_gpu_hour"),
    ("cost.per_tpu_hour=2", "per_tpu_hour"),
])
def test_a_bad_cost_setting_fails_at_config_load_naming_the_key(override, words):
    with pytest.raises(ConfigError) as error:
        load_config(REPO_ROOT / "configs" / "tiny.yaml", [override])
    assert words in str(error.value)


@pytest.mark.slow  # the training flow, twice the tiny run's iterations (~45 s)
def test_quick_overhead_benchmark_reports_the_ledger_and_the_audit_shares(tmp_path):
    """In a fresh interpreter: the benchmark points Prefect at its own throwaway root and stops the
    temporary server it started, which must not be this session's."""
    subprocess.run([sys.executable, "-m", "bench.overhead", "--quick", "--results-dir", str(tmp_path)], cwd=REPO_ROOT,
                   check=True, capture_output=True, timeout=600)
    result = json.loads((tmp_path / "overhead.json").read_text())
    rows = {m["key"]: m for m in result["measurements"]}
    assert set(rows) == {"iteration", "ledger", "audit", "traces"}
    for key in ("ledger", "audit"):
        assert not rows[key].get("skipped"), rows[key]
        assert 0 < rows[key]["ratio"] < rows["iteration"]["ratio"]  # a part of the overhead, not all of it
        assert rows[key]["details"]["seconds"] > 0
    assert rows["audit"]["goal"]["value"] == 0.05
    # tracking.traces (4 by default): logged in every measured iteration, its seconds its own row's
    assert not rows["traces"].get("skipped") and rows["traces"]["goal"]["value"] == 0.02
    assert rows["traces"]["details"]["traces_per_iteration"] == 4
    assert rows["traces"]["ratio"] > 0 and all(s > 0 for s in rows["traces"]["details"]["seconds_per_iteration"])
