"""Rerun one stage of one iteration from the tables of the stage before it.

Only that stage's output is rewritten (e.g. advantages recomputed with another estimator);
other stages' tables are left as they are. Overrides (`algorithm.estimator=rloo`) apply to
this rerun only; the run's recorded config.yaml is not changed.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from agent_core.config import PipelineConfig
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.run_resources import RunResources
from flows.environment import quiet_progress_bars
from tasks.compute_advantages import compute_advantages
from tasks.label_rewards import label_rewards
from tasks.prepare_data import prepare_data, prepare_dataset
from tasks.rollout import rollout
from tasks.run_config import load_run_config, writing_run
from tasks.train import train_policy

STAGES = ("prepare_data", "rollout", "label_rewards", "compute_advantages", "train")


@flow(name="agentr1-rerun-stage", log_prints=True)
def rerun_stage(data_root: str, run_id: str, iteration: int, stage: str, overrides: list[str] | None = None) -> str:
    """Rerun `stage` of `iteration`; return the URI (or checkpoint path) it wrote."""
    quiet_progress_bars()  # a worker's flow run never went through configure_environment
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; valid stages: {', '.join(STAGES)}")
    run = DataRoot(Path(data_root)).run(run_id)
    config = load_run_config(run, [*(overrides or []), f"data_root={data_root}"])
    # The stage's device, engines, cluster and writer thread, freed when it ends (agent_core/run_resources.py).
    with RunResources(config) as resources, writing_run(run):
        return _rerun(run, config, iteration, stage, resources)


def _rerun(run: RunLayout, config: PipelineConfig, iteration: int, stage: str, resources: RunResources) -> str:
    k = iteration
    table = lambda name: run.table_uri(k, name)  # noqa: E731 - reads like the stage list below
    dataset = prepare_dataset(config.data_root, config.data)
    stages = {  # resume=False: an explicit rerun always runs (and its manifest then records the rerun's settings)
        "prepare_data": lambda: prepare_data(run, k, dataset, config.data, config.seed, resume=False),
        "rollout": lambda: rollout(run, k, table("prompts"), dataset.corpus_uri, str(run.policy_dir_before(k)),
                                   config.rollout, config.seed, resume=False, placement=resources.placement),
        "label_rewards": lambda: label_rewards(run, k, table("steps"), table("prompts"), config.reward, resume=False),
        "compute_advantages": lambda: compute_advantages(run, k, table("steps"), table("rewards"), config.algorithm,
                                                         config.trainer, config.rollout.temperature, resume=False,
                                                         device=resources.device_setting),
        "train": lambda: train_policy(run, k, table("steps"), table("advantages"), str(run.policy_dir_before(k)),
                                      config.trainer, config.algorithm, config.rollout.temperature,
                                      config.iterations * config.trainer.epochs * config.trainer.mini_batches,
                                      resume=False, placement=resources.placement, lora=config.policy.lora,
                                      critic=config.critic, runtime=config.runtime),
    }
    return stages[stage]()
