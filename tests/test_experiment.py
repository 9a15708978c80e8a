"""The experiment: its definition, the target checks (values worked out by hand), and a two-arm run
of the real flow on the tiny config that writes the results page, the plots and an MLflow run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from agent_core.eval.experiment import ArmConfig, ExperimentConfig, MethodEm, load_experiment, target_checks
from agent_core.io.layout import DataRoot
from agent_core.io.query import run_query

REPO_ROOT = Path(__file__).resolve().parent.parent


def _exp(**kwargs) -> ExperimentConfig:
    arms = [ArmConfig(name="ppo", title="PPO"), ArmConfig(name="grpo", title="GRPO"),
            ArmConfig(name="ppo-nomask", title="PPO (masks off)", ablation_of="ppo")]
    return ExperimentConfig(base_configs=["base.yaml"], arms=arms, **kwargs)


def test_targets_by_hand():
    em = {"naive_rag": MethodEm(0.1, 0.0), "base_tool_call": MethodEm(0.2, 0.0), "ppo": MethodEm(0.3, 0.0),
          "grpo": MethodEm(0.25, 0.0), "ppo-nomask": MethodEm(0.35, 0.0)}
    ratio, beat_base, ablation = target_checks(_exp(), em)
    # the best algorithm arm (ablations excluded) is PPO: 0.3 / 0.1 = 3.00 >= 2.5
    assert ratio.met and "PPO 0.300 vs Naive RAG 0.100: 3.00x" in ratio.detail
    assert beat_base.met and ablation.target.startswith("PPO (masks off) below PPO") and not ablation.met


def test_ratio_target_is_met_at_exactly_the_ratio():
    em = {"naive_rag": MethodEm(0.1, 0.0), "base_tool_call": MethodEm(0.3, 0.0), "ppo": MethodEm(0.25, 0.0),
          "grpo": MethodEm(0.2, 0.0), "ppo-nomask": MethodEm(0.1, 0.0)}
    ratio, beat_base, ablation = target_checks(_exp(), em)
    assert ratio.met and "2.50x" in ratio.detail
    assert not beat_base.met and "not: PPO, GRPO" in beat_base.detail
    assert ablation.met


def test_differences_inside_the_seed_std_do_not_count():
    # PPO beats base by 0.05 with std 0.06: inside the noise; GRPO by 0.05 with std 0.04: outside.
    # The ablation is 0.05 below PPO, but PPO's std 0.06 swallows it.
    em = {"naive_rag": MethodEm(0.1, 0.0), "base_tool_call": MethodEm(0.2, 0.01), "ppo": MethodEm(0.25, 0.06),
          "grpo": MethodEm(0.25, 0.04), "ppo-nomask": MethodEm(0.2, 0.01)}
    _, beat_base, ablation = target_checks(_exp(), em)
    assert not beat_base.met and beat_base.detail.endswith("not: PPO")
    assert not ablation.met and "0.200 ± 0.010 vs 0.250 ± 0.060" in ablation.detail
    em["ppo"] = MethodEm(0.25, 0.04)
    _, beat_base, ablation = target_checks(_exp(), em)
    assert beat_base.met and ablation.met


def test_experiment_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="distinct names"):
        ExperimentConfig(base_configs=[], arms=[ArmConfig(name="naive_rag", title="x")])
    with pytest.raises(ValueError, match="ablation_of 'ppo'"):
        ExperimentConfig(base_configs=[], arms=[ArmConfig(name="grpo", title="x", ablation_of="ppo")])
    bad = tmp_path / "exp.yaml"
    bad.write_text("base_configs: [a.yaml]\narms: []\neval_sedes: 3\n")
    with pytest.raises(ValueError, match="eval_sedes"):
        load_experiment(bad)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_experiment(tmp_path / "nope.yaml")


def test_the_shipped_experiment_names_every_paper_arm():
    exp, config_dir = load_experiment(REPO_ROOT / "configs" / "experiment.yaml")
    assert {a.name for a in exp.algorithm_arms()} == {"ppo", "grpo", "rloo", "reinforce-pp", "reinforce-pp-baseline",
                                                            "gspo", "steppo", "gigpo"}
    assert {a.name: a.ablation_of for a in exp.arms if a.ablation_of} == {
        "ppo-no-adv-mask": "ppo", "ppo-no-masks": "ppo-no-adv-mask", "grpo-no-loss-mask": "grpo"}
    for arm in exp.arms:
        assert all((config_dir / name).is_file() for name in arm.configs), arm.name
    assert all((config_dir / name).is_file() for name in exp.base_configs)


@pytest.mark.slow  # a whole experiment (a warm start, two arms, the baselines, evaluations): ~40 s on 2 cores
def test_two_arm_experiment_writes_page_plots_tables_and_mlflow(tmp_path):
    from flows.experiment import experiment

    spec = {
        "name": "mini", "base_configs": [str(REPO_ROOT / "configs" / "tiny.yaml")],
        "base_overrides": ["iterations=1", "warm_start.prompts=4", "warm_start.epochs=1", "dev_eval.prompts=2",
                           "data.prompts_per_iteration=2"],
        "arms": [{"name": "grpo", "title": "GRPO", "configs": [str(REPO_ROOT / "configs" / "algos" / "grpo.yaml")]},
                 {"name": "grpo-no-loss-mask", "title": "GRPO (loss mask off)", "ablation_of": "grpo",
                  "configs": [str(REPO_ROOT / "configs" / "algos" / "grpo_no_loss_mask.yaml")]}],
        "eval_seeds": 2, "eval_limit": 3, "eval_split": "dev",
        "report_path": str(tmp_path / "docs" / "results.md"), "plots_dir": str(tmp_path / "docs" / "results"),
        "notes_path": "notes.md",
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "notes.md").write_text("## What did not work\n\nHand-written, kept across reruns.\n")
    exp, config_dir = load_experiment(tmp_path / "exp.yaml")
    data_root = tmp_path / "data"
    result = experiment(exp, str(config_dir), str(data_root), "agentr1 experiment --experiment exp.yaml")

    page = Path(result.report_path).read_text()
    for title in ("Naive RAG", "Base Tool Call", "GRPO", "GRPO (loss mask off)"):
        assert f"| {title} | 2 |" in page  # a table row per method, 2 seeds
    assert "agentr1 experiment --experiment exp.yaml" in page and "Wall time:" in page
    assert "GRPO (loss mask off) below GRPO by more than one seed std" in page
    assert page.rstrip().endswith("Hand-written, kept across reruns.")  # the notes file, after the plots
    for png in ("dev_em.png", "reward.png", "final_em.png"):
        path = tmp_path / "docs" / "results" / png
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(results/{png})" in page  # linked relative to the page
    counts = run_query(data_root, "select method, count(*) as n from eval group by 1 order by 1").to_pylist()
    assert counts == [{"method": m, "n": 2 * 3} for m in sorted(["naive_rag", "base_tool_call", "grpo",
                                                                  "grpo-no-loss-mask"])]
    root = DataRoot(data_root)
    assert (root.runs_dir / f"{result.experiment_id}-base" / "warm_start_policy").is_dir()
    client = MlflowClient(root.mlflow_tracking_uri)
    found = client.search_runs([client.get_experiment_by_name("agentr1-experiment").experiment_id])
    assert len(found) == 1 and "em/grpo" in found[0].data.metrics
    artifacts = {a.path for a in client.list_artifacts(found[0].info.run_id, "plots")}
    assert artifacts == {"plots/dev_em.png", "plots/reward.png", "plots/final_em.png"}
