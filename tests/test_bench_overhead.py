"""bench/overhead.py reads generation, trainer compute and stage seconds from the run's tables
(issue 34: public data, no patched private trainer functions). Fast: hand-written tables; the
benchmark itself runs in tests/test_cost_ledger.py (slow)."""

from __future__ import annotations

import json

import pytest

from agent_core.io.layout import DataRoot
from agent_core.io.ledger import ledger_uri
from agent_core.io.tables import write_table
from bench import overhead
from tests.test_schemas import steps_rows, train_metrics_rows


def _ledger_row(stage: str, seconds: float) -> dict:
    return {"run_id": overhead.RUN_ID, "iteration": 0, "stage": stage, "algorithm": "grpo", "device": "cpu",
            "device_count": 2, "wall_seconds": seconds, "device_seconds": 2 * seconds, "price_per_hour": None,
            "currency": "USD"}


@pytest.fixture
def data_root(tmp_path):
    run = DataRoot(tmp_path).run(overhead.RUN_ID)
    # 2 episodes x 3 steps; each step_idx's two steps came from one lock-step generate call (same generated_at)
    steps = [{**row, "run_id": overhead.RUN_ID, "info": json.dumps({"generate_seconds": 0.5 + row["step_idx"]})}
             for row in steps_rows()]
    write_table("steps", steps, run.table_uri(0, "steps"))
    metrics = [{**row, "run_id": overhead.RUN_ID, "seconds": 1.25} for row in train_metrics_rows()]
    write_table("train_metrics", metrics, run.table_uri(0, "train_metrics"))
    ledger = [_ledger_row("prepare_data", 0.1), _ledger_row("rollout", 5.0), _ledger_row("train", 3.0),
              _ledger_row("init_policy", 40.0)]  # a run stage booked to iteration 0: not the iteration's
    write_table("ledger", ledger, ledger_uri(run, 0))
    return tmp_path


def test_generate_seconds_count_each_call_once_and_compute_sums_the_updates(data_root):
    generate, compute, ledger = overhead.recorded_seconds(data_root)
    assert generate == {0: pytest.approx(0.5 + 1.5 + 2.5)}  # 3 calls; summing the 6 steps would give twice that
    assert compute == {0: pytest.approx(2.5)}
    assert ledger == {0: {"prepare_data": 0.1, "rollout": 5.0, "train": 3.0}}


def test_the_overhead_parts_add_up_to_the_iteration_outside_generate_and_compute(data_root):
    generate, compute, ledger = overhead.recorded_seconds(data_root)
    spans = {"prepare_data": (100.0, 100.2), "record_ledger": (108.5, 108.6), "log_iteration": (108.6, 109.0),
             "audit_iteration": (109.0, 110.0)}
    it = overhead.iteration_breakdown(0, spans, generate[0], compute[0], ledger[0])
    assert it["wall"] == pytest.approx(10.0)
    assert it["overhead"] == pytest.approx(10.0 - 4.5 - 2.5)
    assert sum(it["overhead_parts"].values()) == pytest.approx(it["overhead"])
    assert it["overhead_parts"]["rollout_outside_generate"] == pytest.approx(0.5)
    assert it["stages"]["audit_iteration"] == pytest.approx(1.0)


def test_the_seconds_spent_on_mlflow_traces_are_taken_out_of_the_iteration_and_reported_apart(data_root):
    generate, compute, ledger = overhead.recorded_seconds(data_root)
    spans = {"prepare_data": (100.0, 100.2), "record_ledger": (108.5, 108.6), "log_iteration": (108.6, 109.0),
             "audit_iteration": (109.0, 110.0)}
    without = overhead.iteration_breakdown(0, spans, generate[0], compute[0], ledger[0])
    traced = overhead.iteration_breakdown(0, spans, generate[0], compute[0], ledger[0], traces=0.3)
    assert traced["wall"] == pytest.approx(without["wall"] - 0.3)
    assert traced["stages"]["log_iteration"] == pytest.approx(0.4 - 0.3)
    assert traced["overhead"] == pytest.approx(without["overhead"] - 0.3)
    assert sum(traced["overhead_parts"].values()) == pytest.approx(traced["overhead"])
    row = overhead.traces_measurement([traced, traced], traces=4)  # the first iteration is not measured
    assert row.ratio == pytest.approx(0.3 / traced["wall"]) and row.details["seconds_per_iteration"] == [0.3]
    assert overhead.traces_measurement([without], traces=0).skipped
