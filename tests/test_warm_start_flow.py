"""The training flow with a warm start (scripted oracle episodes -> supervised fine-tuning -> RL) and
the held-out dev evaluation after each iteration, on the tiny config through the real Prefect flow."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agent_core.io.layout import DataRoot
from agent_core.io.manifests import fingerprint, read_manifest
from agent_core.io.query import run_query
from agent_core.io.tables import read_table
from agent_core.io.tombstones import read_tombstone
from agent_core.validation import load_config
from flows.train import train

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    data_root = tmp_path_factory.mktemp("warm")
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        f"data_root={data_root}", "run_id=warm", "warm_start.enabled=true", "warm_start.prompts=6", "warm_start.rag_prompts=3",
        "warm_start.epochs=2", "warm_start.batch_size=4", "dev_eval.prompts=3",
    ])
    result = train(config)
    return config, result, DataRoot(data_root).run("warm")


def test_the_oracle_episodes_are_a_valid_steps_table_with_rewards(warm_run):
    _, _, run = warm_run
    steps = read_table("steps", str(run.warm_start_dir / "steps.parquet"))
    rewards = read_table("rewards", str(run.warm_start_dir / "rewards.parquet"))
    assert steps.num_rows == rewards.num_rows > 0
    episodes = set(steps.column("episode_id").to_pylist())
    assert len({e for e in episodes if e.startswith("warm-warm-")}) == 6  # one per oracle prompt, with tools
    rag = {e for e in episodes if e.startswith("warm-rag-")}
    assert len(rag) == 3 and len(episodes) == 9  # and one step each in the naive_rag format
    # the oracle searches before it answers; under the tiny config's budgets (3 steps, 12 tokens per
    # action) it solves only the prompts whose plan fits, but some
    assert any("<search>" in text for text in steps.column("response_text").to_pylist())
    finals = {r["episode_id"]: r["em"] for r in rewards.to_pylist() if r["em"] is not None}
    assert len(finals) == 9 and sum(finals[e] for e in episodes - rag) >= 1
    assert all(finals[e] == 1.0 for e in rag)  # the gold answer, in <answer> tags


def test_rl_starts_from_the_warm_started_policy(warm_run):
    _, _, run = warm_run
    assert run.start_policy_dir == run.warm_start_policy_dir
    assert run.reference_policy_dir == run.warm_start_policy_dir
    # retention pruned the initial policy once the warm-started one replaced it; its tombstone keeps
    # what the manifests recorded of it, and fine-tuning changed the weights
    assert not run.initial_policy_dir.exists() and run.has_initial_policy
    assert read_tombstone(run.initial_policy_dir).fingerprint != fingerprint(run.warm_start_policy_dir)
    assert fingerprint(run.initial_policy_dir) == read_manifest(run.manifest_path("init_policy")).output_fingerprints["policy"]
    steps = read_table("steps", run.table_uri(0, "steps"))
    assert set(steps.column("policy_version").to_pylist()) == {0}


def test_dev_eval_before_rl_and_after_every_iteration(warm_run):
    config, result, run = warm_run
    start = read_table("eval", run.dev_eval_uri(None))
    assert start.num_rows == 3 and set(start.column("split").to_pylist()) == {"dev"}
    assert set(start.column("checkpoint").to_pylist()) == {str(run.warm_start_policy_dir)}
    for k in range(config.iterations):
        table = read_table("eval", run.dev_eval_uri(k))
        assert set(table.column("checkpoint").to_pylist()) == {str(run.checkpoint_dir(k))}
        em = sum(table.column("em").to_pylist()) / table.num_rows
        assert result.iterations[k].dev_em == pytest.approx(em)
    assert not math.isnan(result.start_dev_em)
    counted = run_query(run.data_root, "select count(*) as n from dev_eval").column("n").to_pylist()
    assert counted == [3 * config.iterations]  # SQL sees every iteration's dev eval (not the start's)


def test_dev_eval_every_second_iteration_and_off(tmp_path):
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml",
                         [f"data_root={tmp_path}", "run_id=sparse", "iterations=3", "dev_eval.every=2",
                          "dev_eval.prompts=2", "data.prompts_per_iteration=1", "rollout.max_new_tokens=6"])
    result = train(config)
    evaluated = [not math.isnan(s.dev_em) for s in result.iterations]
    assert evaluated == [False, True, True]  # after iteration 1 (every 2nd) and the last
    off = train(config.model_copy(update={"run_id": "off", "dev_eval": config.dev_eval.model_copy(update={"every": 0})}))
    assert math.isnan(off.start_dev_em) and all(math.isnan(s.dev_em) for s in off.iterations)
