"""Stage 5: PPO-style updates of the policy (and the critic, for gae / step_gae) on this iteration's
steps; save the next checkpoint, the critic and both optimizers' states.

Training rows are packed episodes where an episode's contexts only append (one forward pass per
episode) and one row per step otherwise (`trainer.layout`). The learning-rate schedule continues
across iterations from the optimizer's own step count.

Numerical safety (agent_core/training/safety.py): an update with non-finite values is skipped and
recorded in `train_metrics`; more than `trainer.max_consecutive_nonfinite` of them in a row
(continuing the previous iteration's trailing run), or a policy or critic whose parameters or
log-probs are no longer finite, raises NonFiniteTrainingError before anything of the iteration is
written: no checkpoint, no optimizer state and no `train_metrics` (a metrics table beside a missing
checkpoint would read as a finished iteration in SQL; the error carries every reason).

Resume: the stage's manifest records its inputs (tables, policy, optimizer state, critic) and
settings; it is committed after every output is in place, so a crash anywhere in between reruns it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from agent_core.algos.estimator_core import estimator_uses_critic
from agent_core.config import AlgorithmConfig, TrainerConfig
from agent_core.io.checkpoints import load_policy, save_critic, save_policy
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.optimizer_state import load_optimizer_state, save_optimizer_state
from agent_core.episodes import episodes_from_rows
from agent_core.io.tables import join_steps, read_table, table_exists, write_table
from agent_core.training.batches import TrainStep, choose_layout
from agent_core.training.critic import build_critic, load_critic
from agent_core.training.schedule import make_lr_scheduler, optimizer_step_count
from agent_core.training.settings import PPOSettings
from agent_core.training.safety import check_nonfinite_updates, check_savable, nonfinite_streaks, probe_logprobs
from agent_core.training.trainer import make_optimizer, train_iteration
from tasks._common import completed_outputs, stage_logger, stage_progress, stage_task

_ADVANTAGE_FIELDS = ("advantages", "ref_logprobs", "values", "returns", "obs_advantages", "obs_returns", "obs_values")
_TRAIN_STEP_FIELDS = [field.name for field in dataclasses.fields(TrainStep)]


def _episodes(steps_uri: str, advantages_uri: str) -> list[list[TrainStep]]:
    """Each episode's steps in order, with their advantages."""
    rows = join_steps(steps_uri, ["group_id", "prompt_ids", "response_ids", "response_logprobs"],
                      "advantages", advantages_uri, _ADVANTAGE_FIELDS)
    steps = [TrainStep(**{name: row[name] for name in _TRAIN_STEP_FIELDS}) for row in rows]
    return [list(episode.steps) for episode in episodes_from_rows(steps)]


def _nonfinite_streak_before(run: RunLayout, iteration: int) -> int:
    """Non-finite skips that ended the previous iteration's training (0 without its table), so a
    run whose single update per iteration is skipped every time still stops."""
    if iteration == 0 or not table_exists(uri := run.table_uri(iteration - 1, "train_metrics")):
        return 0
    return nonfinite_streaks(read_table("train_metrics", uri).column("skip_reason").to_pylist())[1]


def _critic_and_optimizer(run: RunLayout, iteration: int, policy_dir: str, cfg: TrainerConfig):
    critic_dir = run.critic_dir_before(iteration)
    critic = load_critic(critic_dir) if critic_dir.exists() else build_critic(Path(policy_dir))
    optimizer = make_optimizer(critic, lr=cfg.critic_lr, weight_decay=cfg.weight_decay)
    if iteration > 0:
        load_optimizer_state(optimizer, run.critic_optimizer_state_path(iteration - 1))
    return critic, optimizer


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


@stage_task(name="train")
def train_policy(run: RunLayout, iteration: int, steps_uri: str, advantages_uri: str, policy_dir: str,
                 cfg: TrainerConfig, algorithm: AlgorithmConfig, temperature: float, total_steps: int = 0,
                 resume: bool = True) -> str:
    """Update the policy of `policy_dir` and save it as this iteration's checkpoint; return its path.

    total_steps: the decay horizon of a linear/cosine schedule (default: this iteration's steps).
    """
    log = stage_logger("train")
    uses_critic = estimator_uses_critic(algorithm.estimator)
    record = StageRecord(run.manifest_path("train", iteration), "train", inputs=_train_inputs(
        run, iteration, steps_uri, advantages_uri, policy_dir, uses_critic), params={
        "trainer": cfg, "algorithm": algorithm, "temperature": temperature, "total_steps": total_steps,
        "iteration": iteration})
    if (done := completed_outputs(record, resume, f"iteration {iteration} training")) is not None:
        return done["checkpoint"]
    sequences = choose_layout(_episodes(steps_uri, advantages_uri), cfg.layout)
    model, tokenizer = load_policy(Path(policy_dir))
    optimizer = make_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if iteration > 0:
        load_optimizer_state(optimizer, run.optimizer_state_path(iteration - 1))
    steps_now = cfg.epochs * cfg.mini_batches
    scheduler = make_lr_scheduler(optimizer, name=cfg.lr_schedule, base_lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                                  total_steps=max(cfg.total_steps or total_steps, steps_now),
                                  start_step=optimizer_step_count(optimizer))
    critic = critic_optimizer = None
    if uses_critic:
        critic, critic_optimizer = _critic_and_optimizer(run, iteration, policy_dir, cfg)
    with stage_progress("train", f"train iteration {iteration}", "micro-batches"):
        results = train_iteration(model, optimizer, sequences, PPOSettings.from_config(cfg, algorithm, temperature),
                                  pad_id=tokenizer.pad_token_id, critic=critic, critic_optimizer=critic_optimizer,
                                  scheduler=scheduler, seed=iteration)
    check_nonfinite_updates(results, iteration=iteration, max_consecutive=cfg.max_consecutive_nonfinite,
                            carried=_nonfinite_streak_before(run, iteration))
    check_savable(model.named_parameters(), iteration=iteration, probe_logprobs=probe_logprobs(
        model, min(sequences, key=len).input_ids, tokenizer.pad_token_id))
    if critic is not None:
        check_savable(critic.named_parameters(), iteration=iteration, what="critic")
    checkpoint = save_policy(model, tokenizer, run.checkpoint_dir(iteration))
    save_optimizer_state(optimizer, run.optimizer_state_path(iteration))
    if critic is not None:
        save_critic(critic, run.critic_dir(iteration))
        save_optimizer_state(critic_optimizer, run.critic_optimizer_state_path(iteration))
    rows = [{"run_id": run.run_id, "iteration": iteration, "update_idx": i,
             **{k: (None if k == "vf_loss" and math.isnan(v) else v) for k, v in dataclasses.asdict(r).items()}}
            for i, r in enumerate(results)]
    outputs = {"checkpoint": checkpoint, "optimizer": run.optimizer_state_path(iteration),
               "train_metrics": write_table("train_metrics", rows, run.table_uri(iteration, "train_metrics"))}
    if critic is not None:
        outputs.update(critic=run.critic_dir(iteration), critic_optimizer=run.critic_optimizer_state_path(iteration))
    record.commit(outputs)
    for i, r in enumerate(results):
        if r.skipped:
            log.warning("iteration %d, update %d skipped: %s", iteration, i, r.skip_reason)
    last = results[-1]
    log.info("iteration %d: %d updates over %d rows; last: loss %.4f, kl %.5f, clipfrac %.3f, grad norm %.3f%s, "
             "%.0f tokens/s", iteration, len(results), len(sequences), last.loss, last.kl, last.clipfrac,
             last.grad_norm, f", value loss {last.vf_loss:.4f}" if critic is not None else "", last.tokens_per_s)
    return str(checkpoint)
