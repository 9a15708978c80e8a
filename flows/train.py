"""The training flow: prepare data, then N iterations of rollout -> rewards -> advantages -> train.

Reads top to bottom like the pipeline diagram in DESIGN.md §1. Stages pass table URIs only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow

from agent_core.algos.estimator_core import estimator_uses_critic
from agent_core.config import PipelineConfig
from agent_core.io.layout import DataRoot, new_run_id
from agent_core.io.summaries import IterationSummary
from tasks.compute_advantages import compute_advantages
from tasks.init_policy import init_critic, init_policy
from tasks.label_rewards import label_rewards
from tasks.prepare_data import prepare_data, prepare_dataset
from tasks.rollout import rollout
from tasks.run_config import record_config
from tasks.track import finish_tracking, log_iteration, start_tracking
from tasks.train import train_policy


@dataclass(frozen=True)
class TrainResult:
    run_id: str
    run_dir: str
    tracking_uri: str
    mlflow_run_id: str
    model_name: str
    model_version: int
    final_checkpoint: str
    iterations: list[IterationSummary] = field(default_factory=list)


@flow(name="agentr1-train", log_prints=True)
def train(config: PipelineConfig) -> TrainResult:
    if config.run_id is None:  # e.g. a scheduled deployment: every run gets its own id
        config = config.model_copy(update={"run_id": new_run_id()})
    run = DataRoot(Path(config.data_root)).run(config.run_id)
    record_config(run, config)
    dataset = prepare_dataset(config.data_root, config.data)
    policy_dir = init_policy(run, dataset, config.policy)
    if estimator_uses_critic(config.algorithm.estimator):
        init_critic(run, policy_dir)
    tracking = start_tracking(run, config)
    total_steps = config.iterations * config.trainer.epochs * config.trainer.mini_batches

    reports = []
    for k in range(config.iterations):
        prompts = prepare_data(run, k, dataset, config.data, config.seed)
        rollout_started = time.perf_counter()
        steps = rollout(run, k, prompts, dataset.corpus_uri, policy_dir, config.rollout, config.seed)
        rollout_seconds = time.perf_counter() - rollout_started
        rewards = label_rewards(run, k, steps, prompts, config.reward)
        advantages = compute_advantages(run, k, steps, rewards, config.algorithm, config.trainer,
                                        config.rollout.temperature)
        policy_dir = train_policy(run, k, steps, advantages, policy_dir, config.trainer, config.algorithm,
                                  config.rollout.temperature, total_steps)
        reports.append(log_iteration(run, k, tracking, policy_dir, config.tracking.model_name, rollout_seconds))

    finish_tracking(tracking, config.to_yaml())
    return TrainResult(
        run_id=run.run_id, run_dir=str(run.run_dir), tracking_uri=tracking.tracking_uri,
        mlflow_run_id=tracking.mlflow_run_id, model_name=reports[-1].model_name,
        model_version=reports[-1].model_version, final_checkpoint=policy_dir,
        iterations=[r.summary for r in reports],
    )
