"""Stage 5: the policy update (and the critic's) on this iteration's steps; writes the next
checkpoint, the critic, both optimizers' states and the train_metrics table, then the manifest.

The update is `trainer.objective` (ppo built in), run by `agent_core.training.iteration.run_training`
here or on data-parallel Ray workers (the run's placement). Stale steps are refused, a non-finite run
raises before anything is written, and the kept policy and the background writes are the runtime
section's (docs/architecture.md §9 steps 5-6, docs/reliability.md, docs/scale-out.md).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from agent_core.algos.estimator_core import estimator_uses_critic
from agent_core.cluster.placement import Placement
from agent_core.config import (AlgorithmConfig, CriticConfig, PolicyLoraConfig, RuntimeConfig,
                               TrainerConfig)
from agent_core.io import background
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import read_table, table_exists, write_table
from agent_core.training.iteration import Optimization, TrainJob
from agent_core.training.precision import resolve_precision
from agent_core.training.safety import nonfinite_streaks
from agent_core.training.settings import PPOSettings
from tasks._common import completed_outputs, stage_logger, stage_progress, stage_task


class StaleStepsError(ValueError):
    """The steps table holds steps older than runtime.max_staleness allows."""


def check_staleness(steps_uri: str, iteration: int, max_staleness: int) -> int:
    """The largest lag (iteration - policy_version) of the steps; StaleStepsError past `max_staleness`."""
    versions = read_table("steps", steps_uri).column("policy_version").to_pylist()
    oldest = min(versions)
    if iteration - oldest > max_staleness:
        stale = sum(1 for v in versions if iteration - v > max_staleness)
        raise StaleStepsError(
            f"iteration {iteration}: {stale} of {len(versions)} steps come from policy version {oldest}, "
            f"{iteration - oldest} behind; runtime.max_staleness={max_staleness} refuses steps more than "
            f"{max_staleness} version(s) old ({steps_uri})")
    return iteration - oldest


def _nonfinite_streak_before(run: RunLayout, iteration: int) -> int:
    """Non-finite skips that ended the previous iteration's training (0 without its table), so a
    run whose single update per iteration is skipped every time still stops."""
    if iteration == 0 or not table_exists(uri := run.table_uri(iteration - 1, "train_metrics")):
        return 0
    return nonfinite_streaks(read_table("train_metrics", uri).column("skip_reason").to_pylist())[1]


def _train_inputs(run: RunLayout, iteration: int, steps_uri: str, advantages_uri: str, policy_dir: str,
                  uses_critic: bool) -> dict:
    """Everything the update reads: tables, the policy and (after iteration 0) the optimizer state, and
    the critic with its optimizer for estimators with values."""
    inputs = {"steps": steps_uri, "advantages": advantages_uri, "policy": policy_dir,
              "optimizer": run.optimizer_state_path(iteration - 1) if iteration > 0 else None}
    if uses_critic:
        inputs.update(critic=run.critic_dir_before(iteration),
                      critic_optimizer=run.critic_optimizer_state_path(iteration - 1) if iteration > 0 else None)
    return inputs


def train_job(run: RunLayout, iteration: int, steps_uri: str, advantages_uri: str, policy_dir: str,
              cfg: TrainerConfig, algorithm: AlgorithmConfig, temperature: float, total_steps: int, *,
              critic: CriticConfig = CriticConfig(), keep_in_memory: bool = False, background_save: bool = False,
              device: str = "auto") -> TrainJob:
    """Iteration k's TrainJob, the work `agent_core.training.iteration.run_training` does (the train
    stage runs it; benchmarks time it). The flags are the `runtime:` section's, as the stage decides
    them: keep_in_memory (runtime.keep_policy_in_memory), background_save (the optimizer state on the
    writer thread: runtime.background_save, and only where training runs in this process)."""
    critic_files = {}
    if estimator_uses_critic(algorithm.estimator):
        critic_files = dict(critic_in=str(run.critic_dir_before(iteration)),
                            critic_optimizer_in=(str(run.critic_optimizer_state_path(iteration - 1))
                                                 if iteration > 0 else None),
                            critic_out=str(run.critic_dir(iteration)),
                            critic_optimizer_out=str(run.critic_optimizer_state_path(iteration)))
    return TrainJob(
        iteration=iteration, steps_uri=steps_uri, advantages_uri=advantages_uri, policy_dir=policy_dir,
        checkpoint_dir=str(run.checkpoint_dir(iteration)),
        optimizer_in=str(run.optimizer_state_path(iteration - 1)) if iteration > 0 else None,
        optimizer_out=str(run.optimizer_state_path(iteration)),
        settings=PPOSettings.from_config(cfg, algorithm, temperature, critic),
        optimization=Optimization(lr=cfg.lr, weight_decay=cfg.weight_decay, critic_lr=critic.lr,
                                  lr_schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                  total_steps=cfg.total_steps or total_steps),
        layout=cfg.layout, max_consecutive_nonfinite=cfg.max_consecutive_nonfinite,
        carried_nonfinite=_nonfinite_streak_before(run, iteration), keep_in_memory=keep_in_memory,
        background_save=background_save, device=device, **critic_files)


def _result_settings(cfg: TrainerConfig, device: torch.device, critic: CriticConfig = CriticConfig(),
                     runtime: RuntimeConfig = RuntimeConfig()) -> dict:
    """The trainer settings the manifest compares: all but those that cannot change the outputs
    (recomputed activations give the same step up to float rounding; the runtime section's cache and
    background writes), so turning them on or off reruns nothing (and runs recorded before they existed
    still resume). The critic's settings and max_staleness keep their names from before they moved to
    their own sections, so a run recorded then resumes without retraining. The precision is the one
    used on `device` ("auto" on the CPU is "fp32", as runs before "auto" recorded); the training
    objective only when it is not the built-in ppo (runs recorded before objectives were named)."""
    exclude = {"activation_checkpointing"}
    if cfg.objective == "ppo" and not cfg.objective_options:
        exclude |= {"objective", "objective_options"}
    settings = cfg.model_dump(mode="json", exclude=exclude)
    return {**settings, "critic_lr": critic.lr, "value_clip": critic.value_clip,
            "max_staleness": runtime.max_staleness, "precision": resolve_precision(cfg.precision, device)}


@stage_task(name="train")
def train_policy(run: RunLayout, iteration: int, steps_uri: str, advantages_uri: str, policy_dir: str,
                 cfg: TrainerConfig, algorithm: AlgorithmConfig, temperature: float, total_steps: int = 0,
                 resume: bool = True, placement: Placement = Placement(), lora: PolicyLoraConfig | None = None,
                 critic: CriticConfig = CriticConfig(), runtime: RuntimeConfig = RuntimeConfig()) -> str:
    """Update the policy of `policy_dir` and save it as this iteration's checkpoint; return its path.

    total_steps: the decay horizon of a linear/cosine schedule (default: this iteration's steps).
    lora: policy.lora; the checkpoint is then an adapter on the start policy (agent_core/training/lora.py).
    placement: where training runs (the run's, `RunResources.placement`: this process on the run's
    device, or the cluster's data-parallel workers); not a setting the manifest compares (the
    parameters are the same), but the precision "auto" resolves to on its device is.
    critic, runtime: the config's `critic:` and `runtime:` sections.
    """
    log = stage_logger("train")
    background.wait()  # the previous iteration's optimizer state and manifest: inputs and resume state of this one
    uses_critic = estimator_uses_critic(algorithm.estimator)
    record = StageRecord(run.manifest_path("train", iteration), "train", inputs=_train_inputs(
        run, iteration, steps_uri, advantages_uri, policy_dir, uses_critic), params={
        "trainer": _result_settings(cfg, placement.training_device(), critic, runtime), "algorithm": algorithm,
        "temperature": temperature, "total_steps": total_steps, "iteration": iteration, **({"lora": lora} if lora else {})})
    if (done := completed_outputs(record, resume, f"iteration {iteration} training")) is not None:
        return done["checkpoint"]
    lag = check_staleness(steps_uri, iteration, runtime.max_staleness)
    job = train_job(run, iteration, steps_uri, advantages_uri, policy_dir, cfg, algorithm, temperature, total_steps,
                    critic=critic, keep_in_memory=runtime.keep_policy_in_memory,
                    background_save=runtime.background_save and placement.trains_in_process,
                    device=placement.job_device())
    if lora is not None:
        job = dataclasses.replace(job, lora=lora)
    started_at = time.time()
    with stage_progress("train", f"train iteration {iteration}", "micro-batches"):
        results, rows_trained = placement.train(job)
    finished_at = time.time()
    rows = [{"run_id": run.run_id, "iteration": iteration, "update_idx": i,
             **{k: (None if k == "vf_loss" and math.isnan(v) else v) for k, v in dataclasses.asdict(r).items()},
             "started_at": started_at, "finished_at": finished_at}
            for i, r in enumerate(results)]
    outputs = {"checkpoint": job.checkpoint_dir, "optimizer": run.optimizer_state_path(iteration),
               "train_metrics": write_table("train_metrics", rows, run.table_uri(iteration, "train_metrics"))}
    if uses_critic:
        outputs.update(critic=run.critic_dir(iteration), critic_optimizer=run.critic_optimizer_state_path(iteration))
    timing = {"seconds": finished_at - started_at}  # the ledger's train seconds: the span train_metrics records
    if job.background_save:  # after the optimizer states, which run_training queued
        background.submit(f"iteration {iteration}: train manifest", lambda: record.commit(outputs, metrics=timing))
    else:
        record.commit(outputs, metrics=timing)
    for i, r in enumerate(results):
        if r.skipped:
            log.warning("iteration %d, update %d skipped: %s", iteration, i, r.skip_reason)
    last = results[-1]
    log.info("iteration %d: %d updates over %d rows%s; last: loss %.4f, kl %.5f, clipfrac %.3f, grad norm %.3f%s, "
             "%.0f tokens/s", iteration, len(results), rows_trained, f" (steps {lag} version(s) old)" if lag else "",
             last.loss, last.kl, last.clipfrac, last.grad_norm,
             f", value loss {last.vf_loss:.4f}" if uses_critic else "", last.tokens_per_s)
    return job.checkpoint_dir
