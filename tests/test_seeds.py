"""flows/seeds.py: one recipe over several training seeds (the SmolLM2 recipe's driver, `make smollm2-recipe`)."""

from __future__ import annotations

import json

import pytest

from agent_core.io.layout import DataRoot
from agent_core.io.ledger import recorded_seconds
from flows.seeds import SeedRun, main, seeds_table
from tests.conftest import REPO_ROOT


def test_the_table_by_hand():
    runs = [SeedRun("grpo", 0, "r0", 0.5, 0.7, 60.0), SeedRun("grpo", 1, "r1", 0.4, 0.5, 120.0),
            SeedRun("gigpo", 0, "r2", 0.5, 0.5, 60.0)]
    table = seeds_table(runs)
    # grpo: gains 0.2 and 0.1 -> mean 0.150, sample std 0.0707; mean - std = 0.079
    assert "| grpo | 2 | 0.450 ± 0.071 | 0.600 ± 0.141 | 0.150 ± 0.071 | +0.079 | 1.5 min |" in table
    assert "| gigpo | 1 | 0.500 | 0.500 | 0.000 | +nan | 1.0 min |" in table
    assert "| r1 | 1 | 0.400 | 0.500 | +0.100 | 2.0 min |" in table


def test_an_unknown_config_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--config", "no-such-recipe", "--arm", "algos/grpo.yaml", "--out", str(tmp_path / "x")]) == 2
    assert "no-such-recipe" in capsys.readouterr().err
    assert not (tmp_path / "x.md").exists()


@pytest.mark.slow
def test_two_seeds_share_a_start_policy_per_seed_and_write_the_table(tmp_path):
    out = tmp_path / "out" / "tiny"
    command = ["--config", str(REPO_ROOT / "configs" / "tiny.yaml"), "--arm", "algos/grpo.yaml",
               "--arm", "algos/rloo.yaml", "--seeds", "0", "1", "--name", "t", "--data-root", str(tmp_path / "data"),
               "--set", "iterations=1", "--set", "dev_eval.prompts=2"]
    assert main([*command, "--out", str(out)]) == 0
    numbers = json.loads(out.with_suffix(".json").read_text())
    runs = numbers["runs"]
    assert [(r["arm"], r["seed"]) for r in runs] == [("grpo", 0), ("rloo", 0), ("grpo", 1), ("rloo", 1)]
    for run in runs:  # each arm's run started from its seed's base run and was evaluated before and after
        config = (tmp_path / "data" / "runs" / run["run_id"] / "config.yaml").read_text()
        assert f"runs/t-s{run['seed']}-base/" in config and f"seed: {run['seed']}" in config
        assert 0.0 <= run["start_dev_em"] <= 1.0 and 0.0 <= run["final_dev_em"] <= 1.0
    # the arms of one seed start from the same policy: the same start EM
    assert runs[0]["start_dev_em"] == runs[1]["start_dev_em"] and runs[2]["start_dev_em"] == runs[3]["start_dev_em"]
    table = out.with_suffix(".md").read_text()
    assert "| grpo | 2 |" in table and "| rloo | 2 |" in table and "wall time:" in table
    for run in runs:  # a run's time is its stages' recorded seconds
        assert run["seconds"] == pytest.approx(
            recorded_seconds(DataRoot(tmp_path / "data").run(run["run_id"]), 1), abs=1e-6) and run["seconds"] > 0
    # The same command again resumes: every run is skipped, and the table keeps the times they took
    # when they ran (a wall clock around the skip would report a fraction of them).
    again = tmp_path / "again" / "tiny"
    assert main([*command, "--out", str(again)]) == 0
    rerun = json.loads(again.with_suffix(".json").read_text())
    assert [r["run_id"] for r in rerun["runs"]] == [r["run_id"] for r in runs]
    for first, second in zip(runs, rerun["runs"]):
        assert second["seconds"] == pytest.approx(first["seconds"], abs=1e-6)
        assert (second["start_dev_em"], second["final_dev_em"]) == (first["start_dev_em"], first["final_dev_em"])
    # equal to the microsecond: had a stage run again, its manifest would hold the new run's seconds
    assert rerun["warm_start_seconds"] == pytest.approx(numbers["warm_start_seconds"], abs=1e-6)
