"""Stage 5: one PPO update of the policy on this iteration's steps; save the next checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agent_core.config import AlgorithmConfig, TrainerConfig
from agent_core.io.checkpoints import load_policy, save_policy
from agent_core.io.layout import RunLayout
from agent_core.io.optimizer_state import load_optimizer_state, save_optimizer_state
from agent_core.io.tables import read_table, write_table
from agent_core.training.batches import step_sequence
from agent_core.training.trainer import make_optimizer, ppo_update
from tasks._common import stage_logger, stage_task


def _join_steps_and_advantages(steps_uri: str, advantages_uri: str) -> list[dict]:
    """Each step row with its advantages (Arrow's hash join does not carry list columns)."""
    steps = read_table("steps", steps_uri).select(["episode_id", "step_idx", "prompt_ids", "response_ids", "response_logprobs"])
    advantages = read_table("advantages", advantages_uri).select(["episode_id", "step_idx", "advantages"])
    by_step = {(r["episode_id"], r["step_idx"]): r["advantages"] for r in advantages.to_pylist()}
    rows = [{**r, "advantages": by_step.get((r["episode_id"], r["step_idx"]))} for r in steps.to_pylist()]
    missing = [f"{r['episode_id']}/{r['step_idx']}" for r in rows if r["advantages"] is None]
    if missing:
        raise ValueError(f"{advantages_uri}: no advantages for steps {missing[:10]} ({len(missing)} steps)")
    return rows


@stage_task(name="train")
def train_policy(run: RunLayout, iteration: int, steps_uri: str, advantages_uri: str, policy_dir: str,
                 cfg: TrainerConfig, algorithm: AlgorithmConfig, temperature: float) -> str:
    """Update the policy of `policy_dir` and save it as this iteration's checkpoint; return its path."""
    log = stage_logger("train")
    sequences = [
        step_sequence(r["prompt_ids"], r["response_ids"], r["response_logprobs"], r["advantages"])
        for r in _join_steps_and_advantages(steps_uri, advantages_uri)
    ]
    model, tokenizer = load_policy(Path(policy_dir))
    optimizer = make_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if iteration > 0:
        load_optimizer_state(optimizer, run.optimizer_state_path(iteration - 1))
    result = ppo_update(
        model, optimizer, sequences, pad_id=tokenizer.pad_token_id, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip, entropy_coef=cfg.entropy_coef, max_grad_norm=cfg.max_grad_norm,
        micro_batch_tokens=cfg.micro_batch_tokens, temperature=temperature or 1.0, agg_mode=cfg.loss_agg_mode,
        use_loss_mask=algorithm.use_loss_mask, use_advantage_mask=algorithm.use_advantage_mask,
    )
    checkpoint = save_policy(model, tokenizer, run.checkpoint_dir(iteration))
    save_optimizer_state(optimizer, run.optimizer_state_path(iteration))
    metrics = {"run_id": run.run_id, "iteration": iteration, "update_idx": 0, "vf_loss": None,
               **dataclasses.asdict(result)}
    write_table("train_metrics", [metrics], run.table_uri(iteration, "train_metrics"))
    if result.skipped:
        log.warning("iteration %d: update skipped: %s", iteration, result.skip_reason)
    log.info("iteration %d: loss %.4f, kl %.5f, clipfrac %.3f, grad norm %.3f, %d tokens in %.1fs",
             iteration, result.loss, result.kl, result.clipfrac, result.grad_norm, result.tokens, result.seconds)
    return str(checkpoint)
