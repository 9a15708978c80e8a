"""Stage 4: per-token advantages of every step trained on, by the configured estimator. Failed
episodes (and steps with no action) get no row: `algorithm.failed_episodes`.

Also computes what the estimator and the trainer need from frozen models, so the train stage only
trains: the critic's values (estimators that use a critic: gae, step_gae) on the episode grid,
each from the context its token was generated in (``score_on_grid``: a last_k window's steps on
their own contexts), and the reference policy's log-probs of every response (when a KL term is
on), stored in the `advantages` table. A KL in the reward is subtracted here, on action tokens, as
kl_coef * KL(rollout policy || reference) per token.

The reference policy and the critic are scored on the run's `device` (not a setting the manifest
compares: placement does not change what is computed beyond float rounding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from agent_core.algos.estimator_core import ADVANTAGE_ESTIMATORS, estimator_uses_critic
from agent_core.algos.kl import kl_penalty
from agent_core.algos.step_advantages import (
    EpisodeBatch, StepRewardRow, estimate_step_advantages, prepare_episodes, score_on_grid,
)
from agent_core.config import AlgorithmConfig, TrainerConfig
from agent_core.devices import resolve_device
from agent_core.io.checkpoints import load_policy, load_tokenizer
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import join_steps, write_table
from agent_core.training.critic import build_critic, load_critic, score_values
from agent_core.training.lora import reference_policy
from agent_core.training.scoring import score_logprobs
from tasks._common import completed_outputs, stage_logger, stage_task


REWARD_LIMIT = 1e6  # |reward| of a step past which its episode is left out (no task pays that much)


def steps_to_train(steps_uri: str, rewards_uri: str, failed_episodes: str) -> tuple[list[dict], int]:
    """The steps trained on, each with its tokens, log-probs and combined reward (the rewards table's
    `reward`), and how many episodes were left out: failed ones (`algorithm.failed_episodes`), steps
    with no action, and episodes with a reward past REWARD_LIMIT (an env's 1e200 would overflow the
    returns and fail this stage on every resume: left out, named in a warning). Those get no
    advantages row, so the trainer never sees them."""
    rows = join_steps(steps_uri, ["group_id", "prompt_ids", "response_ids", "response_logprobs", "anchor", "done",
                                  "termination"], "rewards", rewards_uri, ["reward"])
    huge = sorted({r["episode_id"] for r in rows if abs(r["reward"]) > REWARD_LIMIT})
    if huge:
        stage_logger("compute_advantages").warning(
            "%s: %d episode(s) with a step reward past +-%g left out of training and of their groups' baselines: %s",
            rewards_uri, len(huge), REWARD_LIMIT, ", ".join(huge[:5]) + (", ..." if len(huge) > 5 else ""))
    left_out = {r["episode_id"] for r in rows if not r["response_ids"]} | set(huge)
    if failed_episodes == "exclude":
        left_out |= {r["episode_id"] for r in rows if r["done"] and r["termination"] == "error"}
    kept = [r for r in rows if r["episode_id"] not in left_out]
    if rows and not kept:
        raise ValueError(f"{steps_uri}: every episode failed ({len(left_out)}); nothing to train on "
                         "(algorithm.failed_episodes=train trains on failed episodes that acted)")
    return kept, len(left_out)


def estimator_settings(cfg: AlgorithmConfig) -> dict:
    """The settings ``estimate_step_advantages`` takes from the algorithm config: plain numbers, and the
    estimator's own settings object built from `estimator_options` by its registered model."""
    return dict(estimator=cfg.estimator, gamma=cfg.gamma, lam=cfg.lam, eps=cfg.eps, norm_by_std=cfg.norm_by_std,
                use_advantage_mask=cfg.use_advantage_mask, use_loss_mask=cfg.use_loss_mask,
                whiten=cfg.whiten_advantages, omega=cfg.gigpo_omega,
                options=ADVANTAGE_ESTIMATORS.settings(cfg.estimator, cfg.estimator_options))


def _critic_values(run: RunLayout, iteration: int, policy_dir: str, batch: EpisodeBatch, trainer: TrainerConfig,
                   pad_id: int, device: torch.device) -> torch.Tensor:
    """[E, T]: the critic of the iteration before, on the batch's grid (``score_on_grid``)."""
    critic_dir = run.critic_dir_before(iteration)
    if critic_dir.exists():
        critic = load_critic(critic_dir)
    else:  # e.g. a rerun of this stage with gae on a run trained without a critic
        stage_logger("compute_advantages").warning("no critic at %s: starting one from %s", critic_dir, policy_dir)
        critic = build_critic(Path(policy_dir))
    critic.to(device)
    return score_on_grid(batch, lambda contexts: score_values(critic, contexts, pad_id, trainer.micro_batch_tokens,
                                                              trainer.precision))


def _reference_logprobs(run: RunLayout, rows: Sequence[dict], trainer: TrainerConfig, temperature: float,
                        device: torch.device, policy_dir: str) -> list[list[float]]:
    """The frozen reference policy's log-probs of each step's response tokens (with LoRA: the policy's
    module kept in memory with its adapter disabled, where there is one: training/lora.py)."""
    sequences = [r["prompt_ids"] + r["response_ids"] for r in rows]
    with reference_policy(run.reference_policy_dir, Path(policy_dir),
                          lambda directory: load_policy(directory, device=device)) as (reference, tokenizer):
        scored = score_logprobs(reference, sequences, tokenizer.pad_token_id, trainer.micro_batch_tokens, temperature,
                                starts=[len(r["prompt_ids"]) for r in rows],  # only the responses get logits
                                precision=trainer.precision)  # as the trainer computes its own log-probs
    return [per_token[len(r["prompt_ids"]):] for r, per_token in zip(rows, scored)]


def _kl_penalty_grid(batch: EpisodeBatch, rows: Sequence[dict], ref_logprobs: list[list[float]], coef: float,
                     estimator: str) -> torch.Tensor:
    """coef * KL(rollout policy || reference) on each step's response tokens of the grid, [E, T]."""
    per_step = {}
    for row, ref in zip(rows, ref_logprobs):
        kl = kl_penalty(torch.tensor([row["response_logprobs"]]), torch.tensor([ref]), estimator)[0]
        per_step[row["episode_id"], row["step_idx"]] = coef * kl
    grid = torch.zeros(batch.layout.input_ids.shape, dtype=torch.float32)
    for e, (episode_id, steps) in enumerate(zip(batch.episode_ids, batch.episode_steps)):
        for step, span in zip(steps, batch.layout.step_spans[e]):
            grid[e, span.start: span.response_end] = per_step[episode_id, step.step_idx]
    return grid


@stage_task(name="compute_advantages")
def compute_advantages(run: RunLayout, iteration: int, steps_uri: str, rewards_uri: str, cfg: AlgorithmConfig,
                       trainer: TrainerConfig | None = None, temperature: float = 1.0, resume: bool = True,
                       device: str = "auto") -> str:
    log = stage_logger("compute_advantages")
    trainer = trainer or TrainerConfig()
    uses_critic, uses_reference = estimator_uses_critic(cfg.estimator), cfg.kl_coef > 0
    record = StageRecord(
        run.manifest_path("compute_advantages", iteration), "compute_advantages",
        inputs={"steps": steps_uri, "rewards": rewards_uri, "policy": run.policy_dir_before(iteration),
                "reference": run.reference_policy_dir if uses_reference else None,
                "critic": run.critic_dir_before(iteration) if uses_critic else None},
        params={"algorithm": cfg, "micro_batch_tokens": trainer.micro_batch_tokens, "temperature": temperature,
                "precision": trainer.precision},
    )
    if (done := completed_outputs(record, resume, f"iteration {iteration} advantages")) is not None:
        return done["advantages"]
    rows, left_out = steps_to_train(steps_uri, rewards_uri, cfg.failed_episodes)
    policy_dir = str(run.policy_dir_before(iteration))
    batch = prepare_episodes([StepRewardRow(**{k: r[k] for k in ("episode_id", "group_id", "step_idx", "prompt_ids",
                                                                  "response_ids", "reward", "anchor")}) for r in rows])
    values = ref_logprobs = penalty = None
    if uses_critic:
        pad_id = load_tokenizer(Path(policy_dir)).pad_token_id  # the tokenizer only: no model loaded for it
        values = _critic_values(run, iteration, policy_dir, batch, trainer, pad_id,
                                resolve_device(device))
    if uses_reference:
        ref_logprobs = _reference_logprobs(run, rows, trainer, temperature or 1.0,
                                           resolve_device(device), policy_dir)
        if cfg.kl_in_reward:
            penalty = _kl_penalty_grid(batch, rows, ref_logprobs, cfg.kl_coef, cfg.kl_estimator)
    results = estimate_step_advantages(batch, **estimator_settings(cfg), values=values, kl_penalty=penalty)
    ref_of = {(r["episode_id"], r["step_idx"]): ref for r, ref in zip(rows, ref_logprobs or [None] * len(rows))}
    out = [
        {"run_id": run.run_id, "iteration": iteration, "episode_id": r.episode_id, "step_idx": r.step_idx,
         "advantages": r.advantages, "returns": r.returns, "values": r.values,
         "ref_logprobs": ref_of[r.episode_id, r.step_idx], "obs_advantages": r.obs_advantages,
         "obs_returns": r.obs_returns, "obs_values": r.obs_values, "estimator": cfg.estimator}
        for r in results
    ]
    uri = write_table("advantages", out, run.table_uri(iteration, "advantages"))
    record.commit({"advantages": uri})
    nonzero = sum(1 for r in results if any(a != 0.0 for a in r.advantages))
    if left_out:
        log.warning("iteration %d: %d failed episodes left out of training and of their groups' baselines "
                    "(algorithm.failed_episodes=%s)", iteration, left_out, cfg.failed_episodes)
    log.info("iteration %d: %s advantages for %d steps (%d with a non-zero signal)%s%s", iteration, cfg.estimator,
             len(results), nonzero, ", critic values" if values is not None else "",
             f", KL to the reference ({cfg.kl_estimator}, {'reward' if cfg.kl_in_reward else 'loss'})" if ref_logprobs else "")
    return uri
