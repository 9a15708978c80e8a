"""The training flow: prepare data, then N iterations of rollout -> rewards -> advantages -> train.

Reads top to bottom like the pipeline diagram in docs/architecture.md §1. Stages pass table URIs only.
With `runtime.max_staleness >= 1` iteration k trains while iteration k+1 rolls out with the newest
finished policy (one version behind); with `cluster.address` set the rollout and training stages
run on Ray (docs/scale-out.md). The recipe is the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow

from agent_core.algos.estimator_core import estimator_uses_critic
from agent_core.config import PipelineConfig
from agent_core.envs.registry import env_offers_tools
from agent_core.io.layout import DataRoot, RunLayout, new_run_id
from agent_core.io.summaries import IterationSummary, eval_scores
from agent_core.run_resources import RunResources
from agent_core.validation import check_names, check_runnable
from flows.environment import name_flow_run, quiet_progress_bars
from tasks.audit import audit_iteration
from tasks.compute_advantages import compute_advantages
from tasks.evaluate import dev_eval, run_eval_settings
from tasks.init_policy import init_critic, init_policy
from tasks.label_rewards import label_rewards
from tasks.ledger import record_ledger
from tasks.prepare_data import DatasetUris, prepare_data, prepare_dataset
from tasks.prune import prune_checkpoints
from tasks.rollout import rollout
from tasks.run_config import record_config, recording_end, writing_run
from tasks.track import finish_tracking, log_iteration, report_run, start_tracking
from tasks.train import train_policy
from tasks.warm_start import oracle_episodes, warm_start


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
    start_dev_em: float = float("nan")  # held-out EM of the policy RL started from (nan: not evaluated)
    stopped: str | None = None  # why the audit ended the run early (audit.on_alert: stop); None: it ran to the end


def _evaluates_after(iteration: int, config: PipelineConfig) -> bool:
    every = config.dev_eval.every
    return every > 0 and ((iteration + 1) % every == 0 or iteration == config.iterations - 1)


def _warm_start(run: RunLayout, dataset: DatasetUris, config: PipelineConfig, policy_dir: str) -> str:
    cfg = config.warm_start
    if cfg.source == "oracle":
        steps, rewards = oracle_episodes(run, dataset, cfg, config.rollout, config.reward, policy_dir, config.seed,
                                         config.data.top_k)
    else:
        steps = cfg.steps_uri
        rewards = str(Path(steps).with_name("rewards.parquet"))
    return warm_start(run, steps, rewards, cfg, config.trainer.micro_batch_tokens, policy_dir, config.seed,
                      device=config.device)


def start_policy(run: RunLayout, config: PipelineConfig) -> tuple[DatasetUris, str]:
    """The dataset and the policy RL starts from: initial policy, then the warm start if enabled."""
    record_config(run, config)
    dataset = prepare_dataset(config.data_root, config.data)
    policy_dir = init_policy(run, dataset, config.policy)
    if config.warm_start.enabled:
        policy_dir = _warm_start(run, dataset, config, policy_dir)
    return dataset, policy_dir


@flow(name="agentr1-train", log_prints=True)
def train(config: PipelineConfig) -> TrainResult:
    """Train, or resume: with the id of an existing run, every stage whose manifest matches its inputs
    and settings is skipped, and the rest (what a crash cut short, what a changed config touches) runs."""
    quiet_progress_bars()  # a worker's flow run never went through configure_environment
    # A config may come from anywhere (a deployment's parameters, a Python caller), not only from
    # agent_core.validation's loaders: a misspelt name must fail here, before anything is written.
    check_names(config)
    if config.run_id is None:  # e.g. a scheduled deployment: every run gets its own id
        config = config.model_copy(update={"run_id": new_run_id()})
    name_flow_run(config.run_id)  # Prefect's UI lists the run's flow runs under its id (`agentr1 view` links there)
    # a missing checkpoint or engine fails before the run folder exists (unless the run copied its policy already)
    check_runnable(config, policy_source=not DataRoot(Path(config.data_root)).run(config.run_id).has_initial_policy)
    # The run's device, engines, cluster, writer thread, resident policy and search indexes: placed
    # on entry, freed on exit in one visible order (agent_core/run_resources.py).
    with RunResources(config) as resources:
        with writing_run(DataRoot(Path(config.data_root)).run(config.run_id)) as run, recording_end(run) as end:
            result = _train(run, config, resources)
            if result.stopped:  # recorded as stopped with the reason (`agentr1 runs`); `agentr1 resume` continues
                end.stop(result.stopped)
            return result


def _finish_iteration(run: RunLayout, k: int, checkpoint: str, dataset: DatasetUris, config: PipelineConfig,
                      eval_settings, tracking, reports: list, audits: list) -> tuple[str, int]:
    """After iteration k's training: evaluate if due, log it, audit it, prune; the new policy and its version (k + 1)."""
    if _evaluates_after(k, config):
        dev_eval(run, k, checkpoint, dataset, config.dev_eval, eval_settings)
    reports.append(log_iteration(run, k, tracking, checkpoint))
    offers_tools = env_offers_tools(config.rollout.env, config.rollout.env_kwargs)
    audits.append(audit_iteration(run, k, config.audit, tracking, offers_tools=offers_tools))  # behaviour health checks
    # what checkpoints.* lets go, now that k is committed (files, then the run's registered versions)
    prune_checkpoints(run, k, config.checkpoints, tracking.tracking_uri, tracking.model_name)
    record_ledger(run, k, config)  # the iteration's stage seconds, the audit's too, priced (README "What a run cost")
    return checkpoint, k + 1


def _train(run: RunLayout, config: PipelineConfig, resources: RunResources) -> TrainResult:
    device = resources.device_setting  # the stages resolve it where their models load
    dataset, policy_dir = start_policy(run, config)
    if estimator_uses_critic(config.algorithm.estimator):
        init_critic(run, policy_dir)
    eval_settings = run_eval_settings(config, greedy=True)
    start_dev_em = float("nan")
    if config.dev_eval.every > 0:
        start_dev_em, _ = eval_scores(dev_eval(run, None, policy_dir, dataset, config.dev_eval, eval_settings))
    tracking = start_tracking(run, config)
    total_steps = config.iterations * config.trainer.epochs * config.trainer.mini_batches

    reports, audits = [], []
    overlap = config.runtime.max_staleness >= 1  # rollout k+1 runs while iteration k trains
    version, training = 0, None  # the version policy_dir holds; the training still running, if any
    for k in range(config.iterations):
        if any(audit.stop for audit in audits):  # audit.on_alert: stop (with overlap, the training under way finishes)
            break
        prompts = prepare_data(run, k, dataset, config.data, config.seed)
        steps = rollout(run, k, prompts, dataset.corpus_uri, policy_dir, config.rollout, config.seed,
                        policy_version=version, placement=resources.placement)
        resources.after_rollout()  # the engine's memory goes back to the device before scoring and training
        if training is not None:  # iteration k-1 trained while this rollout ran; its critic is read next
            policy_dir, version = _finish_iteration(run, k - 1, training.result(), dataset, config, eval_settings,
                                                    tracking, reports, audits)
        rewards = label_rewards(run, k, steps, prompts, config.reward)
        advantages = compute_advantages(run, k, steps, rewards, config.algorithm, config.trainer,
                                        config.rollout.temperature, device=device)
        train_args = (run, k, steps, advantages, policy_dir, config.trainer, config.algorithm,
                      config.rollout.temperature, total_steps)
        if overlap:  # the next rollout starts now, with policy_dir (this training's result comes later)
            training = train_policy.submit(*train_args, placement=resources.placement, lora=config.policy.lora,
                                           critic=config.critic, runtime=config.runtime)
        else:
            checkpoint = train_policy(*train_args, placement=resources.placement, lora=config.policy.lora,
                                      critic=config.critic, runtime=config.runtime)
            policy_dir, version = _finish_iteration(run, k, checkpoint, dataset, config, eval_settings, tracking,
                                                    reports, audits)
    if training is not None:
        policy_dir, version = _finish_iteration(run, config.iterations - 1, training.result(), dataset, config,
                                                eval_settings, tracking, reports, audits)

    report_run(run, tracking, [r.summary for r in reports], start_dev_em,
               f"{reports[-1].model_name} version {reports[-1].model_version}")
    finish_tracking(tracking, config.to_yaml(), {"start_dev_em": start_dev_em})
    return TrainResult(
        run_id=run.run_id, run_dir=str(run.run_dir), tracking_uri=tracking.tracking_uri,
        mlflow_run_id=tracking.mlflow_run_id, model_name=reports[-1].model_name,
        model_version=reports[-1].model_version, final_checkpoint=policy_dir,
        iterations=[r.summary for r in reports], start_dev_em=start_dev_em,
        stopped=next((audit.reason for audit in audits if audit.stop), None),
    )
