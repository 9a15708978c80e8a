"""PPO optimizer steps and a PPO training iteration (token log-probs: agent_core.training.scoring).

``ppo_update`` makes exactly one optimizer step per call: token-sized micro-batches whose losses use
normalizers over ALL sequences of the step; a non-finite input, output, loss or gradient norm skips the step
(agent_core.training.safety). ``train_iteration`` runs `epochs` passes of `mini_batches` such steps. Unlike
verl-style trainers, the "old" log-probs default to the engine's sampling log-probs (action tokens only).
Design notes: docs/architecture.md §11 (agent_core/training/trainer.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

import torch

from agent_core.algos.kl import kl_penalty
from agent_core.algos.losses import POLICY_LOSSES, aggregate_loss, clipped_value_loss, masked_sum
from agent_core.algos.masks import Masks
from agent_core.failpoints import failpoint
from agent_core.progress import report
from agent_core.training.batches import PaddedBatch, TrainSequence
from agent_core.training.data_parallel import DataParallel
from agent_core.training.memory import AUTO
from agent_core.training.oom import RestartStep, TokenBudget, backward, run_with_splits
from agent_core.training.precision import activation_checkpointing, autocast
from agent_core.training.prepared import Prepared, prepare_update, split_rows, training_micro_batch_tokens
from agent_core.training.settings import PPOSettings
from agent_core.training.update_result import Totals, UpdateResult, update_result
from agent_core.training.safety import (
    CRITIC_INPUTS, NONFINITE, POLICY_INPUTS, FiniteWatch, SkipUpdate, nonfinite_inputs,
)
from agent_core.training.scoring import score_logprobs, sequence_logprobs


def make_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999)
) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (one group: weight decay applies to all).

    The fused implementation: one kernel per parameter instead of the default foreach ops, which on
    SmolLM2-135M take 0.5-0.8 s per step on 2 CPU cores against 0.09 s, and allocate a temporary the
    size of the parameters (+0.5 GiB at the step) where fused allocates nothing (docs/benchmarks.md).
    The update is the same AdamW; the state_dict has the same keys, so states saved by either load.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (requires_grad is False everywhere)")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=True)


def _policy_micro_batch(model, batch: PaddedBatch, masks: Masks, prep: Prepared, s: PPOSettings,
                        totals: Totals, watch: FiniteWatch) -> torch.Tensor:
    """Forward + backward of one policy micro-batch; adds its metrics to totals, returns its loss.

    Only the loss-mask tokens get logits (``sequence_logprobs(positions=...)``): every value below
    is read at those tokens alone (the KL mask is inside the loss mask).
    """
    with autocast(batch.input_ids.device, s.precision):
        logprobs, entropy = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=s.temperature,
                                              entropy_grad=s.entropy_coef != 0, positions=masks.loss_mask > 0,
                                              position_count=batch.loss_targets, right_padded=True)
    watch.output(logprobs, batch.attention_mask, "log-probs")
    old_logprobs = batch.old_logprobs
    if not s.recompute_old_logprobs:  # loss tokens the engine did not sample: ratio 1 (module docstring)
        old_logprobs = torch.where((masks.loss_mask > 0) & (batch.action_mask == 0), logprobs.detach(), old_logprobs)
    scale = prep.policy_norms.scale()
    policy = POLICY_LOSSES.get(s.policy_loss)(
        logprobs, old_logprobs, batch.advantages, masks.loss_mask,  # its own advantage per token
        clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip, agg_mode=s.agg_mode,
        options=s.policy_loss_options, **scale)
    loss = policy.loss
    if s.entropy_coef != 0:
        loss = loss - s.entropy_coef * aggregate_loss(entropy, masks.loss_mask, s.agg_mode, **scale)
    batch_tokens = masks.loss_mask.sum()
    if batch.ref_logprobs is not None:
        kl_mask = masks.loss_mask * batch.action_mask
        kl_tokens = kl_penalty(logprobs, batch.ref_logprobs, s.kl_estimator)
        if s.kl_coef != 0:
            loss = loss + s.kl_coef * aggregate_loss(kl_tokens, kl_mask, s.agg_mode, **prep.kl_norms.scale())
        kl = dict(kl_sum=masked_sum(kl_tokens.detach(), kl_mask), kl_tokens=kl_mask.sum())
    else:
        kl = dict(kl_sum=policy.approx_kl * batch_tokens, kl_tokens=batch_tokens)
    backward(loss)  # totals only after it: a micro-batch that runs out of memory is retried (oom.py)
    totals.add(**kl, loss=loss, pg_loss=policy.loss, entropy_sum=masked_sum(entropy.detach(), masks.loss_mask),
               clipped_sum=policy.clipfrac * batch_tokens, real_tokens=batch.attention_mask.sum())
    return loss.detach()


def _critic_micro_batch(critic, batch: PaddedBatch, masks: Masks, prep: Prepared, s: PPOSettings,
                        totals: Totals, watch: FiniteWatch) -> torch.Tensor:
    """Forward + backward of the clipped value loss on the advantage-mask tokens (they have returns)."""
    with autocast(batch.input_ids.device, s.precision):
        values = critic.values(batch.input_ids, batch.attention_mask, right_padded=True).float()
    watch.output(values, batch.attention_mask, "values")
    out = clipped_value_loss(values, batch.old_values, batch.returns, masks.advantage_mask, clip_range=s.value_clip,
                             agg_mode=s.agg_mode, **prep.value_norms.scale())
    loss = s.vf_coef * out.loss
    backward(loss)
    totals.add(vf_loss=out.loss)
    return loss.detach()


def _local_skip_reason(pairs, micro_step, count_progress: bool, budget: TokenBudget) -> str | None:
    """Forward + backward of these (batch, masks) pairs, split to fit `budget` (oom.run_with_splits);
    the skip reason, or None. Outputs and losses are checked on the device and read once at the end
    (`FiniteWatch`): no host synchronisation per micro-batch."""
    watch = FiniteWatch()
    try:
        for batch_loss in run_with_splits(pairs, lambda b, m: micro_step(b, m, watch), budget, split_rows):
            watch.loss(batch_loss)
            if count_progress:
                report(1)
    except SkipUpdate as skip:
        return str(skip)
    return watch.reason()


def _micro_batches_skip_reason(prep: Prepared, micro_step, count_progress: bool, budget: TokenBudget,
                               dp: DataParallel | None = None) -> str | None:
    """Forward + backward of every micro-batch (this rank's shard with `dp`); why the step must be
    skipped, or None. Each policy micro-batch is reported as progress (`count_progress`; the
    critic's pass over the same batches is not).

    With `dp` the ranks agree (one collective, which every rank reaches even after a local skip):
    a skip on any rank skips the step on all, else their optimizers would diverge. Another rank's
    reason is not sent; it is named generically, still marked non-finite when it was (safety's
    consecutive-skip check counts those).
    """
    pairs = list(zip(prep.batches, prep.masks))
    reason = _local_skip_reason(pairs if dp is None else dp.shard(pairs), micro_step, count_progress, budget)
    if dp is None:
        return reason
    skipped, nonfinite = dp.sum_floats([float(reason is not None), float(NONFINITE in (reason or ""))])
    if reason is None and nonfinite > 0:
        return f"{NONFINITE} value in a micro-batch on another worker"
    if reason is None and skipped > 0:
        return "the step was skipped on another worker"
    return reason


def _accumulate_and_step(module, optimizer, prep: Prepared, micro_step, max_grad_norm,
                         inputs: tuple[str, ...], budget: TokenBudget, totals: Totals, count_progress: bool = True,
                         dp: DataParallel | None = None) -> tuple[float, str | None]:
    """Run micro_step over every micro-batch (accumulating gradients), clip, and step unless not finite.

    inputs: the batch tensors this module's loss reads; any nan/inf there skips the step before a
    forward pass (every rank checks all batches, so all agree without a collective). With `dp`
    only this rank's micro-batches run (on the plain module) and the gradients are summed over
    ranks by torch's DDP before clipping (``DataParallel.sum_gradients``), so every rank clips and
    steps identically. Returns (grad norm, skip reason or None). A backward pass that ran out of
    memory restarts the step from zero gradients and these totals at a halved budget (oom.py).
    Gradients are cleared either way; the module gets its previous train/eval mode back.
    """
    was_training = module.training
    module.train()
    optimizer.zero_grad(set_to_none=True)
    grad_norm, saved = math.nan, replace(totals)
    try:
        while True:
            try:
                skip_reason = (nonfinite_inputs(prep.batches, inputs)
                               or _micro_batches_skip_reason(prep, micro_step, count_progress, budget, dp))
                break
            except RestartStep:
                optimizer.zero_grad(set_to_none=True)
                totals.restore(saved)
        if skip_reason is None:
            if dp is not None:
                dp.sum_gradients(module)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            limit = math.inf if max_grad_norm is None else max_grad_norm
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
            if math.isfinite(grad_norm):
                optimizer.step()
                failpoint("train:optimizer_step")  # a crash between updates of one iteration
            else:
                skip_reason = f"non-finite gradient norm ({grad_norm})"
        optimizer.zero_grad(set_to_none=True)
    finally:
        module.train(was_training)
    return grad_norm, skip_reason


def _update(policy, optimizer, sequences, s: PPOSettings, *, critic, critic_optimizer, pad_id,
            budget: TokenBudget, dp: DataParallel | None = None) -> tuple[UpdateResult, bool]:
    """One policy optimizer step (and one critic step when a critic is given) over `sequences`, in
    micro-batches of `budget` tokens (halved, for this update and the next, at each out-of-memory split).

    With `dp` every rank passes the same sequences (so the normalizers are the step's) and runs its
    shard of the micro-batches. Returns the metrics and whether the policy step was taken.
    """
    if not sequences:
        raise ValueError("an update needs at least one sequence")
    started, splits = time.perf_counter(), budget.splits
    budget.tokens = _agreed_tokens(budget.tokens, dp)
    prep = prepare_update(sequences, next(policy.parameters()).device, pad_id=pad_id,
                          micro_batch_tokens=budget.tokens, use_loss_mask=s.use_loss_mask,
                          use_advantage_mask=s.use_advantage_mask, norm_length=s.norm_length)
    totals, grad_norm, reasons = Totals(), math.nan, []
    if prep.policy_norms.num_tokens > 0:  # global counts: every rank takes the same branch
        with activation_checkpointing(policy, s.activation_checkpointing):
            grad_norm, reason = _accumulate_and_step(
                policy, optimizer, prep, lambda b, m, w: _policy_micro_batch(policy, b, m, prep, s, totals, w),
                s.max_grad_norm, POLICY_INPUTS, budget, totals, dp=dp)
        policy_skipped = reason is not None
        reasons += [reason] if reason else []
    else:
        policy_skipped = True
        reasons.append("no tokens in the loss mask")
    critic_skipped = True
    if critic is not None and prep.value_norms.num_tokens > 0:
        _, reason = _accumulate_and_step(
            critic, critic_optimizer, prep, lambda b, m, w: _critic_micro_batch(critic, b, m, prep, s, totals, w),
            s.max_grad_norm, CRITIC_INPUTS, budget, totals, count_progress=False, dp=dp)
        critic_skipped = reason is not None
        reasons += [f"critic: {reason}"] if reason else []
    result = update_result(totals.summed(dp), prep, policy_skipped, critic_skipped, grad_norm, reasons,
                     lr=float(optimizer.param_groups[0]["lr"]), seconds=time.perf_counter() - started)
    return replace(result, oom_splits=budget.splits - splits), not policy_skipped


def _agreed_tokens(tokens: int, dp: DataParallel | None) -> int:
    """The smallest rank's budget (free memory and out-of-memory splits differ by rank): every rank
    must cut the same micro-batches, since each trains its `dp.shard` of them. One small collective."""
    if dp is None or dp.world_size == 1:
        return tokens
    slots = [0.0] * dp.world_size
    slots[dp.rank] = float(tokens)
    return int(min(dp.sum_floats(slots)))


def ppo_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sequences: Sequence[TrainSequence],
               settings: PPOSettings, *, pad_id: int, dp: DataParallel | None = None) -> UpdateResult:
    """ONE optimizer step of the policy loss over all `sequences` (no critic; epochs, mini_batches,
    recompute_old_logprobs and max_logit_elements of `settings` are not used here).

    Gradients are accumulated over micro-batches of <= micro_batch_tokens padded tokens with
    normalizers counted over all sequences, then clipped to max_grad_norm (None: not clipped).
    norm_length: the seq-mean-token-sum-norm constant (default: the largest number of loss tokens
    in one sequence of this update; pass the generation budget for Dr.GRPO's fixed constant).
    kl_coef > 0 adds kl_coef * KL(kl_estimator) to the reference (sequences' ref_logprobs).
    The learning rate is read from the optimizer (the caller owns the schedule). The model is in
    train mode during the update and gets its previous mode back afterwards.
    dp: data parallelism (module docstring): every rank passes the same `sequences` and runs its
    share of the micro-batches; None is one process.
    """
    one_step = replace(settings, recompute_old_logprobs=False)
    tokens = settings.micro_batch_tokens  # not capped by max_logit_elements here; "auto" as train_iteration's
    if tokens == "auto" and sequences:
        tokens = _micro_batch_tokens(model, optimizer, sequences, settings, None, None)
    result, _ = _update(model, optimizer, sequences, one_step, critic=None, critic_optimizer=None, pad_id=pad_id,
                        budget=TokenBudget(tokens), dp=dp)
    return result


def _micro_batch_tokens(policy, optimizer, sequences, s: PPOSettings, critic, critic_optimizer) -> int:
    return training_micro_batch_tokens(
        policy, optimizer, sequences, tokens=s.micro_batch_tokens, logits=s.max_logit_elements, precision=s.precision,
        checkpointing=s.activation_checkpointing, use_loss_mask=s.use_loss_mask, critic=critic,
        critic_optimizer=critic_optimizer)


def _check_iteration_inputs(sequences, critic, critic_optimizer, kl_coef) -> None:
    if not sequences:
        raise ValueError("train_iteration needs at least one training sequence")
    if (critic is None) != (critic_optimizer is None):
        raise ValueError("give both critic and critic_optimizer, or neither")
    if critic is not None and any(s.old_values is None or s.returns is None for s in sequences):
        raise ValueError("a critic update needs old_values and returns on every training sequence "
                         "(computed by the advantages stage)")
    if kl_coef > 0 and any(s.ref_logprobs is None for s in sequences):
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs on every training sequence (or set kl_coef=0)")


def train_iteration(
    policy: torch.nn.Module,
    policy_optimizer: torch.optim.Optimizer,
    sequences: Sequence[TrainSequence],
    settings: PPOSettings,
    *,
    pad_id: int,
    critic: torch.nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    seed: int = 0,
    dp: DataParallel | None = None,
) -> list[UpdateResult]:
    """PPO on one iteration's sequences: `settings.epochs` passes, each over `settings.mini_batches`
    shuffled mini-batches.

    One policy optimizer step per mini-batch (see ``ppo_update``) and, with a critic, one critic
    step on the clipped value loss (value_clip; None = unclipped) scaled by vf_coef, with its own
    optimizer and the same max_grad_norm. The shuffle is drawn from a generator seeded by `seed`.
    recompute_old_logprobs: the old log-probs of every position are the policy's before the
    first step (else the rollout's sampling log-probs). The scheduler, if given, steps after
    every policy step that was taken. Fewer sequences than mini_batches (packing shrinks the row
    count) gives one mini-batch per sequence. Returns one UpdateResult per mini-batch, in order.
    Micro-batch size: ``prepared.training_micro_batch_tokens`` (on the CPU micro_batch_tokens
    capped so that it x the vocabulary <= max_logit_elements; on CUDA with "auto", from free memory).
    dp: data parallelism (module docstring): every rank passes the same sequences and seed (so the
    same shuffle) and runs its share of each step's micro-batches; None is one process.
    """
    s = settings
    _check_iteration_inputs(sequences, critic, critic_optimizer, s.kl_coef)
    micro_batch_tokens = _micro_batch_tokens(policy, policy_optimizer, sequences, s, critic, critic_optimizer)
    budget = TokenBudget(micro_batch_tokens)  # shared by the updates: a split carries over to the next
    if s.recompute_old_logprobs:  # every rank scores all sequences: no collective, same old log-probs
        scoring_tokens = micro_batch_tokens if s.micro_batch_tokens != AUTO else AUTO  # auto: scoring's own size
        fresh = score_logprobs(policy, [q.input_ids for q in sequences], pad_id, scoring_tokens, s.temperature,
                               starts=[q.region_start for q in sequences],  # the loss never reads earlier ones
                               precision=s.precision)
        sequences = [replace(q, old_logprobs=logprobs) for q, logprobs in zip(sequences, fresh)]
    generator = torch.Generator().manual_seed(seed)
    results = []
    updates = s.epochs * min(s.mini_batches, len(sequences))
    for _ in range(s.epochs):
        order = torch.randperm(len(sequences), generator=generator)
        for chunk in torch.tensor_split(order, min(s.mini_batches, len(sequences))):
            result, policy_stepped = _update(
                policy, policy_optimizer, [sequences[i] for i in chunk.tolist()], s, critic=critic,
                critic_optimizer=critic_optimizer, pad_id=pad_id, budget=budget, dp=dp)
            if scheduler is not None and policy_stepped:
                scheduler.step()
            results.append(result)
            report(0, update=f"{len(results)}/{updates}", loss=result.loss)  # micro-batches were counted as they ran
    return results
