"""The benchmark suite's plumbing: a --quick training benchmark writes a well-formed result, and the
report turns results into the page (goals, misses, skips, the hand-written part kept).

No timing is asserted (timings belong in the benchmarks, as ratios; this only checks they run)."""

from __future__ import annotations

import json
import math

import pytest

from bench import report, training
from bench.common import Goal, Measurement, skipped_measurement, write_result


@pytest.fixture(scope="module")
def training_result(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    assert training.main(["--quick", "--results-dir", str(results)]) == 0
    return results, json.loads((results / "training.json").read_text())


def test_quick_training_benchmark_writes_both_ratios(training_result):
    _, result = training_result
    assert {"name", "title", "command", "machine", "finished_at", "wall_seconds", "config", "measurements",
            "notes"} <= set(result)
    assert result["name"] == "training" and "--quick" in result["command"]
    assert result["machine"]["cpus"] >= 1
    by_key = {m["key"]: m for m in result["measurements"]}
    assert set(by_key) == {"trainer", "packed_vs_step"}
    for m in by_key.values():
        assert math.isfinite(m["ratio"]) and m["ratio"] > 0
        assert m["goal"]["op"] in (">=", "<=") and m["met"] in (True, False)
        assert m["skipped"] == ""
    # both arms of the trainer ratio trained on the same tokens; step rows carry more of them
    details = by_key["trainer"]["details"]
    assert details["trainer"]["tokens_per_update"] == details["raw_loop"]["tokens_per_update"] > 0
    assert by_key["packed_vs_step"]["details"]["token_ratio"] > 1


def test_report_lists_every_ratio_goal_and_miss_and_keeps_hand_written_text(training_result, tmp_path):
    results, result = training_result
    write_result("scaling", "Scaling title", [
        Measurement("episodes", 1.5, Goal("time ratio / size ratio", "<=", 1.2), {"points": [{"episodes": 2}]},
                    why_missed="grew faster than the work"),
        skipped_measurement("steps_per_episode", Goal("time ratio / size ratio", "<=", 1.2), "no engine here"),
    ], seconds=1.0, results_dir=results, argv=["--quick"])
    page = tmp_path / "benchmarks.md"
    page.write_text("old generated text\n" + report.MARKER + "\n## Analysis\nkept by hand\n")
    assert report.main(["--results-dir", str(results), "--output", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Benchmarks") and "old generated text" not in text
    assert text.endswith(report.MARKER + "\n## Analysis\nkept by hand\n")
    assert result["title"] in text and "Scaling title" in text
    for m in result["measurements"]:
        assert f"| {m['key']} | {report.fmt(m['ratio'])} |" in text
        assert ("met" if m["met"] else "**MISSED**") in text
    assert "| episodes | 1.5 | <= 1.2 | **MISSED** |" in text
    assert "grew faster than the work" in text
    assert "steps_per_episode** skipped: no engine here" in text
    assert "make bench" in text


def test_skipped_measurements_are_null_in_strict_json(tmp_path):
    path = write_result("x", "X", [skipped_measurement("vllm", None, "not installed")], seconds=0.0,
                        results_dir=tmp_path, argv=[])
    data = json.loads(path.read_text())  # strict JSON: no NaN
    assert data["measurements"][0]["ratio"] is None and data["measurements"][0]["met"] is None
