"""One training iteration from tables to checkpoint, in this process or on each data-parallel
worker (the train stage, tasks/train.py, and agent_core/cluster/trainers.py run the same code).

A `TrainJob` holds plain paths and settings (it travels to Ray workers). Every worker runs `train_iteration`
on its `DataParallel` share of each step's micro-batches; only rank 0 writes checkpoint, optimizer and critic.
One process may also keep the policy in memory (`keep_in_memory`) and save in background (`background_save`).
Design notes: docs/architecture.md §11 (agent_core/training/iteration.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from agent_core.config import PolicyLoraConfig
from agent_core.devices import resolve_device
from agent_core.episodes import episodes_from_rows
from agent_core.io import background
from agent_core.io.checkpoints import load_policy, save_critic, save_policy
from agent_core.io.lora_checkpoints import save_lora_policy
from agent_core.io.optimizer_state import load_optimizer_state, save_optimizer_state
from agent_core.io.tables import join_steps
from agent_core.training import resident
from agent_core.training.batches import TrainStep, choose_layout
from agent_core.training.critic import build_critic, load_critic
from agent_core.training.data_parallel import DataParallel
from agent_core.training.lora import has_lora, inject_lora
from agent_core.training.schedule import make_lr_scheduler, optimizer_step_count
from agent_core.training.settings import PPOSettings
from agent_core.training.safety import check_nonfinite_updates, check_savable, probe_logprobs
from agent_core.training.objectives import TRAINING_OBJECTIVES
from agent_core.training.trainer import UpdateResult, make_optimizer

_ADVANTAGE_FIELDS = ("advantages", "ref_logprobs", "values", "returns", "obs_advantages", "obs_returns", "obs_values")
_TRAIN_STEP_FIELDS = [field.name for field in dataclasses.fields(TrainStep)]


@dataclass(frozen=True)
class Optimization:
    """The optimizers' plain settings: lr and schedule of the policy, lr of the critic."""

    lr: float
    weight_decay: float
    critic_lr: float
    lr_schedule: str
    warmup_steps: int
    total_steps: int  # decay horizon of a linear/cosine schedule


@dataclass(frozen=True)
class TrainJob:
    """Everything one iteration's training reads and writes. *_in paths are None where there is no
    previous state (iteration 0); critic_in is built from the policy when the folder does not exist."""

    iteration: int
    steps_uri: str
    advantages_uri: str
    policy_dir: str
    checkpoint_dir: str
    optimizer_in: str | None
    optimizer_out: str
    settings: PPOSettings
    optimization: Optimization
    layout: str
    max_consecutive_nonfinite: int
    carried_nonfinite: int
    critic_in: str | None = None  # set iff the estimator uses a critic
    critic_optimizer_in: str | None = None
    critic_out: str | None = None
    critic_optimizer_out: str | None = None
    keep_in_memory: bool = False  # keep what is saved for the next job that reads it (resident.py); one process only
    background_save: bool = False  # optimizer states on the writer thread (io/background.py); one process only
    lora: PolicyLoraConfig | None = None  # policy.lora: a full policy_dir gets a fresh adapter (training/lora.py)
    device: str = "auto"  # the run's `device` setting, resolved where the job runs (a worker: its own GPU or CPU)


def job_sequences(job: TrainJob):
    """The iteration's training sequences: each episode's steps with their advantages, in its layout."""
    rows = join_steps(job.steps_uri, ["group_id", "prompt_ids", "response_ids", "response_logprobs"],
                      "advantages", job.advantages_uri, _ADVANTAGE_FIELDS, every_step=False)
    steps = [TrainStep(**{name: row[name] for name in _TRAIN_STEP_FIELDS}) for row in rows]
    return choose_layout([list(episode.steps) for episode in episodes_from_rows(steps)], job.layout)


def _policy_settings(job: TrainJob) -> tuple:
    # Stricter than needed (a reload gets its lr from the scheduler and its weight decay from the
    # saved state), so a changed setting never depends on that detail of AdamW.load_state_dict.
    return job.optimization.lr, job.optimization.weight_decay


def _critic_settings(job: TrainJob) -> tuple:
    return job.optimization.critic_lr, job.optimization.weight_decay


def _policy(job: TrainJob, keep: bool):
    """(model, tokenizer, optimizer): what the previous iteration kept, if it saved them to this job's
    inputs; else loaded from them."""
    if keep and (kept := resident.take(resident.POLICY, (job.policy_dir, job.optimizer_in),
                                       _policy_settings(job))) is not None:
        return kept
    model, tokenizer = load_policy(Path(job.policy_dir), device=resolve_device(job.device))
    if job.lora is not None and not has_lora(model):  # a LoRA checkpoint comes with its adapter
        inject_lora(model, job.lora, Path(job.policy_dir))
    optimizer = make_optimizer(model, lr=job.optimization.lr, weight_decay=job.optimization.weight_decay)
    if job.optimizer_in is not None:
        load_optimizer_state(optimizer, Path(job.optimizer_in))
    return model, tokenizer, optimizer


def _critic(job: TrainJob, keep: bool):
    if keep and (kept := resident.take(resident.CRITIC, (job.critic_in, job.critic_optimizer_in),
                                       _critic_settings(job))) is not None:
        return kept
    critic = load_critic(Path(job.critic_in)) if Path(job.critic_in).exists() else build_critic(Path(job.policy_dir))
    critic.to(resolve_device(job.device))
    optimizer = make_optimizer(critic, lr=job.optimization.critic_lr, weight_decay=job.optimization.weight_decay)
    if job.critic_optimizer_in is not None:
        load_optimizer_state(optimizer, Path(job.critic_optimizer_in))
    return critic, optimizer


def _save(job: TrainJob, policy: tuple, critic: tuple | None, modes: list[dict], keep: bool, later: bool) -> None:
    """Write the checkpoint, optimizer state and critic; with `keep`, hold them for the next job too,
    in the train/eval modes they were loaded in (`modes`: the policy's, then the critic's). With
    `later`, the optimizer states (and the holding, which stamps their files) go to the writer thread."""
    model, tokenizer, optimizer = policy
    (save_lora_policy if has_lora(model) else save_policy)(model, tokenizer, Path(job.checkpoint_dir))
    if critic is not None:
        save_critic(critic[0], Path(job.critic_out))
    if keep:
        resident.restore_modes(model, modes[0])
        resident.offer(job.checkpoint_dir, model, tokenizer)  # the next rollout's hf engine generates with it
        if critic is not None:
            resident.restore_modes(critic[0], modes[1])

    def optimizer_states() -> None:
        save_optimizer_state(optimizer, Path(job.optimizer_out))
        if critic is not None:
            save_optimizer_state(critic[1], Path(job.critic_optimizer_out))
        if keep:
            resident.keep(resident.POLICY, (job.checkpoint_dir, job.optimizer_out), _policy_settings(job), policy)
            if critic is not None:
                resident.keep(resident.CRITIC, (job.critic_out, job.critic_optimizer_out), _critic_settings(job),
                              critic)

    if later:
        background.submit(f"iteration {job.iteration}: optimizer state", optimizer_states)
    else:
        optimizer_states()


def run_training(job: TrainJob, dp: DataParallel | None = None) -> tuple[list[UpdateResult], int]:
    """Train one iteration; (one result per optimizer step, the rows trained). Rank 0 (or the only
    process) writes the outputs; a non-finite run raises before anything is written."""
    background.wait()  # the previous iteration's optimizer state, if it is still being written
    sequences = job_sequences(job)
    keep = job.keep_in_memory and dp is None
    if not keep:
        resident.forget()
    model, tokenizer, optimizer = _policy(job, keep)
    modes = [resident.training_modes(model)]
    opt = job.optimization
    steps_now = job.settings.epochs * job.settings.mini_batches
    scheduler = make_lr_scheduler(optimizer, name=opt.lr_schedule, base_lr=opt.lr, warmup_steps=opt.warmup_steps,
                                  total_steps=max(opt.total_steps, steps_now), start_step=optimizer_step_count(optimizer))
    critic = critic_optimizer = None
    if job.critic_in is not None:
        critic, critic_optimizer = _critic(job, keep)
        modes.append(resident.training_modes(critic))
    else:
        resident.forget(resident.CRITIC)  # one kept by a job with a critic is never read now
    objective, options = job.settings.objective, job.settings.objective_options
    results = TRAINING_OBJECTIVES.get(objective)(
        model, optimizer, sequences, job.settings, options=TRAINING_OBJECTIVES.settings(objective, options),
        pad_id=tokenizer.pad_token_id, critic=critic, critic_optimizer=critic_optimizer, scheduler=scheduler,
        seed=job.iteration, dp=dp)
    check_nonfinite_updates(results, iteration=job.iteration, max_consecutive=job.max_consecutive_nonfinite,
                            carried=job.carried_nonfinite)
    check_savable(model.named_parameters(), iteration=job.iteration, probe_logprobs=probe_logprobs(
        model, min(sequences, key=len).input_ids, tokenizer.pad_token_id))
    if critic is not None:
        check_savable(critic.named_parameters(), iteration=job.iteration, what="critic")
    if dp is None or dp.rank == 0:
        _save(job, (model, tokenizer, optimizer), None if critic is None else (critic, critic_optimizer), modes, keep,
              later=job.background_save and dp is None)
    return results, len(sequences)
