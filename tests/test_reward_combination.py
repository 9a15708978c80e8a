"""Process and outcome rewards are combined once, at labelling; the advantages stage trains on that
value and the iteration summary logs that value, also off the default weight and normalizer."""

from __future__ import annotations

import json
import math

import pytest

from agent_core.algos.step_advantages import StepRewardRow, estimate_step_advantages, prepare_episodes
from agent_core.config import AlgorithmConfig, RewardConfig
from agent_core.io.summaries import episode_rewards
from agent_core.io.tables import read_table, write_table
from tasks._common import label_steps_table
from tasks.compute_advantages import estimator_settings, steps_to_train
from tests.test_schemas import steps_rows

# Process rewards per (episode, step): episode sums -0.3 and +0.6, so max_abs divides by 0.6.
PROCESS = {("ep-0", 0): -0.1, ("ep-0", 1): -0.2, ("ep-1", 0): 0.6}


def _labelled(tmp_path, cfg: RewardConfig) -> tuple[str, str]:
    rows = steps_rows()
    for row in rows:
        row["env_reward"] = PROCESS.get((row["episode_id"], row["step_idx"]), 0.0)
        if row["done"]:  # ep-0 answers right, ep-1 wrong
            row["info"] = json.dumps({"answer": "Paris" if row["episode_id"] == "ep-0" else "Rome"})
    steps_uri = write_table("steps", rows, tmp_path / "steps.parquet")
    rewards_uri = str(tmp_path / "rewards.parquet")
    label_steps_table(steps_uri, {"q0": ["Paris"]}, cfg, "r1", 0, rewards_uri)
    return steps_uri, rewards_uri


def _trained_rewards(steps_uri: str, rewards_uri: str) -> list[float]:
    """Per episode, the sum of the token rewards the advantages stage hands its estimator."""
    rows, _ = steps_to_train(steps_uri, rewards_uri, "exclude")
    batch = prepare_episodes([StepRewardRow(**{k: r[k] for k in ("episode_id", "group_id", "step_idx", "prompt_ids",
                                                                "response_ids", "reward")}) for r in rows])
    return batch.layout.token_rewards.sum(dim=-1).tolist()


def test_logged_mean_reward_is_the_reward_the_advantages_stage_uses(tmp_path):
    cfg = RewardConfig(format_weight=0.0, process_weight=0.5, process_norm="max_abs")
    steps_uri, rewards_uri = _labelled(tmp_path, cfg)
    trained = _trained_rewards(steps_uri, rewards_uri)
    # by hand: factor 0.5 / 0.6; ep-0: 1 (EM) + factor * -0.3 = 0.75; ep-1: 0 + factor * 0.6 = 0.5
    assert trained == pytest.approx([0.75, 0.5])
    count, mean_reward = episode_rewards(rewards_uri)
    assert count == 2 and mean_reward == pytest.approx(sum(trained) / 2)
    table = read_table("rewards", rewards_uri).to_pylist()
    assert [row["process_factor"] for row in table] == pytest.approx([0.5 / 0.6] * len(table))
    # the components stay as they were: raw process reward, outcome on the terminal step only
    assert sum(row["process_reward"] for row in table) == pytest.approx(0.3)
    assert sum(row["outcome_reward"] for row in table) == pytest.approx(1.0)


def test_default_combination_is_the_plain_sum(tmp_path):
    steps_uri, rewards_uri = _labelled(tmp_path, RewardConfig(format_weight=0.0))
    assert _trained_rewards(steps_uri, rewards_uri) == pytest.approx([0.7, 0.6])
    assert episode_rewards(rewards_uri)[1] == pytest.approx(0.65)


def _with_a_failed_episode(tmp_path, failed_episodes: str) -> tuple[list[dict], int]:
    """ep-1 ended in an error (an agent program that crashed after its calls)."""
    rows = steps_rows()
    for row in rows:
        if row["done"]:
            failed = row["episode_id"] == "ep-1"
            row.update(termination="error" if failed else "answered",
                       info=json.dumps({"error": "exit code 1: the agent fell over"} if failed else {"answer": "Paris"}))
    steps_uri = write_table("steps", rows, tmp_path / f"{failed_episodes}-steps.parquet")
    rewards_uri = str(tmp_path / f"{failed_episodes}-rewards.parquet")
    label_steps_table(steps_uri, {"q0": ["Paris"]}, RewardConfig(format_weight=0.0), "r1", 0, rewards_uri)
    return steps_to_train(steps_uri, rewards_uri, failed_episodes)


def test_a_failed_episode_is_left_out_of_training_and_of_its_groups_baseline(tmp_path):
    kept, left_out = _with_a_failed_episode(tmp_path, "exclude")
    assert left_out == 1 and {r["episode_id"] for r in kept} == {"ep-0"}
    batch = prepare_episodes([StepRewardRow(**{k: r[k] for k in ("episode_id", "group_id", "step_idx", "prompt_ids",
                                                                "response_ids", "reward")}) for r in kept])
    (only,) = estimate_step_advantages(batch, **estimator_settings(AlgorithmConfig()))[-1:]
    assert all(a == 0.0 for a in only.advantages)  # alone in its group: no one to be better than
    trained, left_out = _with_a_failed_episode(tmp_path, "train")  # the switch: kept, with its reward 0
    assert left_out == 0 and {r["episode_id"] for r in trained} == {"ep-0", "ep-1"}
    assert [r["reward"] for r in trained if r["done"]] == [1.0, 0.0]


def test_an_episode_with_a_reward_past_the_limit_is_left_out_not_the_stage_failed(tmp_path):
    """An env (a plugin's, say) paying 1e200: its returns would overflow and the advantages table would
    fail its `finite` check on every resume. The episode is left out; the rest trains, finite."""
    rows = steps_rows()
    for row in rows:
        row["env_reward"] = 1e200 if (row["episode_id"], row["step_idx"]) == ("ep-1", 0) else 0.0
    steps_uri = write_table("steps", rows, tmp_path / "steps.parquet")
    rewards_uri = str(tmp_path / "rewards.parquet")
    label_steps_table(steps_uri, {"q0": ["Paris"]}, RewardConfig(format_weight=0.0), "r1", 0, rewards_uri)
    kept, left_out = steps_to_train(steps_uri, rewards_uri, "exclude")
    assert left_out == 1 and {r["episode_id"] for r in kept} == {"ep-0"}
    batch = prepare_episodes([StepRewardRow(**{k: r[k] for k in ("episode_id", "group_id", "step_idx", "prompt_ids",
                                                                "response_ids", "reward")}) for r in kept])
    for result in estimate_step_advantages(batch, **estimator_settings(AlgorithmConfig())):
        assert all(math.isfinite(a) for a in result.advantages + result.returns)
