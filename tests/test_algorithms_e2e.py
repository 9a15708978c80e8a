"""Every algorithm of the paper and both mask ablations: a short training through the real flow,
layering configs/algos/<name>.yaml on configs/tiny.yaml (one iteration, a handful of episodes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agent_core.io.layout import DataRoot
from agent_core.io.tables import read_table
from agent_core.validation import load_config
from flows.train import train

REPO_ROOT = Path(__file__).resolve().parent.parent
ALGOS = sorted(p.stem for p in (REPO_ROOT / "configs" / "algos").glob("*.yaml"))
SMALL = ["iterations=1", "dev_eval.every=0", "data.prompts_per_iteration=2", "rollout.group_size=2", "rollout.max_steps=2",
         "rollout.max_new_tokens=8", "trainer.mini_batches=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data_root = tmp_path_factory.mktemp("algos")
    trained = {}
    for name in ALGOS:
        config = load_config([REPO_ROOT / "configs" / "tiny.yaml", REPO_ROOT / "configs" / "algos" / f"{name}.yaml"],
                             [*SMALL, f"data_root={data_root}", f"run_id={name.replace('_', '-')}"])
        result = train(config)
        run = DataRoot(data_root).run(result.run_id)
        trained[name] = (config, run, read_table("advantages", run.table_uri(0, "advantages")),
                         read_table("train_metrics", run.table_uri(0, "train_metrics")))
    return trained


def test_the_paper_algorithms_and_ablations_all_have_configs():
    assert set(ALGOS) == {"grpo", "ppo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                          "ppo_no_advantage_mask", "ppo_no_masks", "grpo_no_loss_mask", "gspo", "steppo", "gigpo"}


@pytest.mark.parametrize("name", ALGOS)
def test_each_algorithm_trains_with_finite_metrics(runs, name):
    config, run, advantages, metrics = runs[name]
    assert set(advantages.column("estimator").to_pylist()) == {config.algorithm.estimator}
    rows = metrics.to_pylist()
    assert len(rows) == config.trainer.epochs * config.trainer.mini_batches
    for row in rows:
        if not row["skipped"]:
            assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["tokens"] > 0
    assert (run.checkpoint_dir(0) / "model.safetensors").is_file()
    # a KL to the reference needs its log-probs, stored per response token
    assert all(r is not None for r in advantages.column("ref_logprobs").to_pylist()) == (config.algorithm.kl_coef > 0)


@pytest.mark.parametrize("name", ["ppo", "ppo_no_advantage_mask", "ppo_no_masks"])
def test_ppo_trains_a_critic(runs, name):
    _, run, advantages, metrics = runs[name]
    assert run.critic_dir(0).is_dir() and run.initial_critic_dir.is_dir()
    assert all(v is not None for v in advantages.column("values").to_pylist())
    assert any(r["vf_loss"] is not None and math.isfinite(r["vf_loss"]) for r in metrics.to_pylist())


def test_critic_free_algorithms_have_no_critic(runs):
    _, run, advantages, metrics = runs["grpo"]
    assert not run.critic_dir(0).exists()
    assert all(v is None for v in advantages.column("values").to_pylist())
    assert all(r["vf_loss"] is None for r in metrics.to_pylist())


def by_step(run_name: str, runs) -> dict:
    """(episode id without the run id, step_idx) -> the step's response_ids and advantages row, iteration 0."""
    config, run, advantages, _ = runs[run_name]
    steps = read_table("steps", run.table_uri(0, "steps")).to_pylist()
    rows = {(r["episode_id"], r["step_idx"]): r for r in advantages.to_pylist()}
    local = lambda episode_id: episode_id.removeprefix(config.run_id)  # noqa: E731
    return {(local(s["episode_id"]), s["step_idx"]): (s["response_ids"], rows[s["episode_id"], s["step_idx"]])
            for s in steps}


def same_rollout(a: dict, b: dict) -> bool:
    """Same config seed, same initial policy: iteration 0 samples the same steps in both runs."""
    return a.keys() == b.keys() and all(a[k][0] == b[k][0] for k in a)


def action_values(steps: dict, column: str) -> list[float]:
    return [x for key in sorted(steps) for x in steps[key][1][column]]


# A from-scratch tiny policy earns no reward here, so its advantages are KL noise: that each
# ablation changes the trained signal is shown on a fixed rewarded batch (tests/test_ablations.py).
# These tests check what the pipeline stores for each ablation on the same rollout.

def test_advantage_mask_off_stores_observation_targets_and_keeps_action_value_targets(runs):
    on, off = by_step("ppo", runs), by_step("ppo_no_advantage_mask", runs)
    assert same_rollout(on, off)
    assert all(row["obs_advantages"] is None for _, row in on.values())
    with_observation = [row for _, row in off.values() if row["obs_advantages"]]
    assert with_observation and all(len(r["obs_returns"]) == len(r["obs_advantages"]) for r in with_observation)
    # gamma = lam = 1 (and the same initial critic): the same value targets on action tokens
    assert action_values(on, "returns") == pytest.approx(action_values(off, "returns"), abs=1e-5)


def test_loss_mask_off_keeps_action_advantages_and_gives_observations_their_episodes(runs):
    for base, ablation in (("grpo", "grpo_no_loss_mask"), ("ppo_no_advantage_mask", "ppo_no_masks")):
        on, off = by_step(base, runs), by_step(ablation, runs)
        assert same_rollout(on, off)
        assert action_values(on, "advantages") == pytest.approx(action_values(off, "advantages"), abs=1e-6)
    grpo_off = [row for _, row in by_step("grpo_no_loss_mask", runs).values() if row["obs_advantages"]]
    assert grpo_off and all(r["obs_advantages"] == pytest.approx([r["advantages"][-1]] * len(r["obs_advantages"]))
                            for r in grpo_off)


def test_loss_mask_off_trains_on_more_tokens(runs):
    masked = sum(r["tokens"] for r in runs["ppo_no_advantage_mask"][3].to_pylist())
    unmasked = sum(r["tokens"] for r in runs["ppo_no_masks"][3].to_pylist())
    assert unmasked > masked


def test_grpo_loss_mask_off_trains_on_more_tokens(runs):
    masked = sum(r["tokens"] for r in runs["grpo"][3].to_pylist())
    unmasked = sum(r["tokens"] for r in runs["grpo_no_loss_mask"][3].to_pylist())
    assert unmasked > masked
