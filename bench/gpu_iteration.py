"""One whole RL iteration through the library, in one process, for bench/gpu.py (rows `iteration*`, `lora*`).

The stages are the pipeline's (tasks/rollout.py, label_rewards.py, compute_advantages.py,
train.py) without Prefect, Parquet or MLflow, so they run where only torch, transformers, peft
and pydantic are installed; each calls the same agent_core functions the stage does:

- rollout: `agent_core.drivers.roll_out` (the config's envs, each through its driver, with the config's loop settings)
  with the built-in search env on its BM25 index and the `HFEngine` a colocated run builds: on CUDA
  a bf16 copy of the trainer's module refreshed before the rollout (rollout.hf.dtype auto), on the
  CPU the module itself; KV reuse across each episode's turns (rollout.hf);
- labelling: `label_steps` (agent_core.rewards) with the reward config's defaults;
- advantages: the reference's log-probs of every response (`score_logprobs` under the trainer's
  precision; the reference is a frozen copy of the start policy, or with LoRA the same module with
  its adapter disabled), then
  `estimate_step_advantages` with the algorithm config's defaults (GRPO);
- training: `train_iteration` with `PPOSettings.from_config` of the trainer config's defaults
  (precision auto, the micro-batch budget the library picks for the device) and a KL loss term.

Each stage's seconds (CUDA synchronised) and its peak allocated GPU memory
(`torch.cuda.max_memory_allocated`, reset before the stage) are returned.
"""

from __future__ import annotations

import copy
import gc
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path

import torch

from agent_core.algos.step_advantages import StepRewardRow, estimate_step_advantages, prepare_episodes
from agent_core.config import AlgorithmConfig, RewardConfig, RolloutConfig, TrainerConfig
from agent_core.drivers import DataAccess, roll_out
from agent_core.episodes import episodes_from_rows
from agent_core.rewards.labelling import StepOutcome, label_steps
from agent_core.rollout.hf_engine import HFEngine
from agent_core.rollout.inference_copy import InferenceCopy, inference_dtype, parameter_dtype
from agent_core.rollout.spec import RolloutSpec
from agent_core.training.batches import TrainStep, choose_layout
from agent_core.training.scoring import score_logprobs
from agent_core.training.settings import PPOSettings
from agent_core.training.trainer import make_optimizer, train_iteration

GIB = 2**30


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class StageClock:
    """Seconds and peak allocated GPU memory (GiB; None on the CPU) of each stage, in order."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.peak_gib = device, {}, {}

    @contextmanager
    def stage(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        synchronize(self.device)
        started = time.perf_counter()
        try:
            yield
        except BaseException as error:  # bench/gpu.py names the stage an out-of-memory error happened in
            error.add_note(f"stage {name}")
            raise
        synchronize(self.device)
        self.seconds[name] = round(time.perf_counter() - started, 3)
        self.peak_gib[name] = (round(torch.cuda.max_memory_allocated(self.device) / GIB, 2)
                               if self.device.type == "cuda" else None)


def rollout(model, tokenizer, task, cfg: RolloutConfig, prompts: int, seed: int,
            copies: InferenceCopy | None = None) -> list:
    """`prompts` x group_size episodes of the built-in task (agent_core/drivers roll_out's steps: the
    config's envs and its loop settings, agent_core/rollout/spec.py), with the engine a colocated run
    builds (agent_core/run_resources.py): the trainer's module itself where it samples in the module's
    dtype, else the inference copy `copies` refreshed from it (bf16 on CUDA, rollout.hf.dtype); KV reuse
    and the cache as rollout.hf says."""
    dtype = inference_dtype(cfg.hf.dtype, next(model.parameters()).device)
    module, lease = model, None
    if parameter_dtype(model) != dtype:
        copies = copies if copies is not None else InferenceCopy(dtype)
        module, lease = copies.refresh(model), copies
    engine = HFEngine.configured(module, tokenizer, cfg.hf, max_batch_size=cfg.max_batch_size,
                                 release=lease.release if lease is not None else None)
    try:
        return roll_out(engine, tokenizer, task.prompts[:prompts], task.documents, cfg, seed=seed,
                        policy_version=0, episode_prefix="gpu-", spec=RolloutSpec.from_config(cfg),
                        access=DataAccess())
    finally:
        engine.close()


def rewards_of(records, task) -> dict[tuple[str, int], float]:
    """The combined reward of each step (label_steps with the reward config's defaults)."""
    cfg = RewardConfig()
    answers = {p.prompt_id: list(p.answers) for p in task.prompts}
    outcomes = [StepOutcome(r.episode_id, r.group_id, r.prompt_id, r.sample_idx, r.step_idx, r.env_reward, r.done,
                            r.termination, r.info) for r in records]
    labelled = label_steps(outcomes, answers, scorer=cfg.scorer, format_weight=cfg.format_weight,
                           process_weight=cfg.process_weight, process_norm=cfg.process_norm)
    return {(r.episode_id, r.step_idx): r.reward for r in labelled}


def estimator_settings(cfg: AlgorithmConfig) -> dict:
    """As tasks/compute_advantages.estimator_settings (not imported: tasks/ needs Prefect)."""
    return dict(estimator=cfg.estimator, gamma=cfg.gamma, lam=cfg.lam, eps=cfg.eps, norm_by_std=cfg.norm_by_std,
                use_advantage_mask=cfg.use_advantage_mask, use_loss_mask=cfg.use_loss_mask,
                whiten=cfg.whiten_advantages)


def train_steps(records, rewards, reference, pad_id: int, algorithm: AlgorithmConfig,
                trainer: TrainerConfig, temperature: float) -> list[TrainStep]:
    """Reference log-probs (under the trainer's precision, as tasks/compute_advantages.py scores them) and
    advantages of every step, joined as the train stage joins them."""
    scored = score_logprobs(reference, [r.prompt_ids + r.response_ids for r in records], pad_id,
                            trainer.micro_batch_tokens, temperature, starts=[len(r.prompt_ids) for r in records],
                            precision=trainer.precision)
    ref = {(r.episode_id, r.step_idx): s[len(r.prompt_ids):] for r, s in zip(records, scored)}
    batch = prepare_episodes([StepRewardRow(r.episode_id, r.group_id, r.step_idx, r.prompt_ids, r.response_ids,
                                            rewards[r.episode_id, r.step_idx]) for r in records])
    advantages = {(a.episode_id, a.step_idx): a
                  for a in estimate_step_advantages(batch, **estimator_settings(algorithm))}
    steps = []
    for r in records:
        a = advantages[r.episode_id, r.step_idx]
        steps.append(TrainStep(r.prompt_ids, r.response_ids, r.response_logprobs, a.advantages,
                               ref_logprobs=ref[r.episode_id, r.step_idx], values=a.values, returns=a.returns,
                               obs_advantages=a.obs_advantages, obs_returns=a.obs_returns,
                               obs_values=a.obs_values, episode_id=r.episode_id, group_id=r.group_id,
                               step_idx=r.step_idx))
    return steps


@contextmanager
def frozen_copy(model):
    """The reference of a full fine-tuning run: a frozen copy of the start policy, freed after scoring
    (the advantages stage loads it from disk and drops it the same way)."""
    reference = copy.deepcopy(model).requires_grad_(False)
    try:
        yield reference
    finally:
        del reference


def rl_iteration(model, tokenizer, task, *, prompts: int, rollout_cfg: RolloutConfig, kl_coef: float,
                 seed: int, lora: bool = False) -> dict:
    """Rollout -> labelling -> advantages (reference log-probs) -> one training iteration; per stage
    seconds and peak GPU memory, plus the work done. `lora`: the model carries a LoRA adapter, whose
    reference is the same module with the adapter disabled."""
    device = next(model.parameters()).device
    trainer, algorithm = TrainerConfig(), AlgorithmConfig(kl_coef=kl_coef)
    settings = PPOSettings.from_config(trainer, algorithm, rollout_cfg.temperature)
    clock = StageClock(device)
    # kept for the iteration, as a run keeps it (RunResources): training sizes its micro-batches beside it
    copies = InferenceCopy(inference_dtype(rollout_cfg.hf.dtype, device))
    with clock.stage("rollout"):
        records = rollout(model, tokenizer, task, rollout_cfg, prompts, seed, copies)
    with clock.stage("labelling"):
        rewards = rewards_of(records, task)
    if lora:
        from agent_core.training.lora import adapter_disabled

        reference_scope = adapter_disabled(model)
    else:
        reference_scope = frozen_copy(model)
    with clock.stage("advantages"):
        with reference_scope as reference:
            steps = train_steps(records, rewards, reference, tokenizer.pad_token_id, algorithm, trainer,
                                rollout_cfg.temperature)
        free_memory(device)
    with clock.stage("training"):
        sequences = choose_layout([list(e.steps) for e in episodes_from_rows(steps)], trainer.layout)
        optimizer = make_optimizer(model, lr=trainer.lr, weight_decay=trainer.weight_decay)
        results = train_iteration(model, optimizer, sequences, settings, pad_id=tokenizer.pad_token_id, seed=seed)
        del optimizer
    copies.close()
    free_memory(device)
    peaks = [v for v in clock.peak_gib.values() if v is not None]
    return {
        "seconds": round(sum(clock.seconds.values()), 3), "stage_seconds": clock.seconds,
        "peak_gib": max(peaks) if peaks else None, "stage_peak_gib": clock.peak_gib,
        "episodes": len({r.episode_id for r in records}), "steps": len(records),
        "generated_tokens": sum(len(r.response_ids) for r in records),
        "scored_tokens": sum(len(r.prompt_ids) + len(r.response_ids) for r in records) if kl_coef > 0 else 0,
        "inference_dtype": str(copies.dtype).removeprefix("torch."),
        "train_rows": len(sequences), "train_tokens": sum(len(s) for s in sequences),
        "updates": len(results), "skipped_updates": sum(r.skipped for r in results),
        "oom_splits": sum(getattr(r, "oom_splits", 0) for r in results),
        "train_tokens_per_s": round(sum(r.tokens_per_s for r in results) / max(1, len(results)), 1),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "settings": {k: v for k, v in asdict(settings).items() if k in (
            "micro_batch_tokens", "max_logit_elements", "precision", "kl_coef")},
    }


def memory_limit(device: torch.device, gib: float | None):
    """A context that caps this process's CUDA allocations at `gib` GiB (as a card of that size would),
    or nothing (None, or the CPU, where no limit applies: the row then says so)."""
    if gib is None or device.type != "cuda":
        return nullcontext()

    # the fraction's setter wants an index: torch.device("cuda") (the current card) raises ValueError
    index = device.index if device.index is not None else torch.cuda.current_device()

    @contextmanager
    def limited():
        free_memory(device)
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total), index)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, index)

    return limited()


def lora_settings():
    """`policy.lora`'s defaults, or None while agent_core/training/lora.py is not there."""
    try:
        from agent_core.config import PolicyLoraConfig
        from agent_core.training.lora import inject_lora  # noqa: F401
    except ImportError:
        return None
    return PolicyLoraConfig()


def with_lora(model, settings) -> torch.nn.Module:
    from agent_core.training.lora import inject_lora

    return inject_lora(model, settings, Path("random-init"))  # the base is recorded, never read here
