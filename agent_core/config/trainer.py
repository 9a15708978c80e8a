"""The `trainer:` section: the policy update (agent_core/training)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from agent_core.config._base import int_or_auto, Section


class TrainerConfig(Section):
    """The policy update: optimizer, learning-rate schedule, PPO clipping and loss, micro-batching and
    memory (agent_core/training). The critic's optimizer is the `critic:` section; how the trained
    policy is kept between iterations, `runtime:`."""

    lr: float = Field(5e-4, ge=0, description="0 makes no update (a dry run; the learning test's control)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay of the policy's and the "
                                "critic's optimizers (every trainable parameter)")
    clip_low: float = Field(0.2, ge=0, description="PPO clip: the ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="PPO clip: the ratio is clipped above at 1 + clip_high (raise it "
                             "above clip_low for DAPO's clip-higher)")
    dual_clip: float | None = Field(None, gt=1, description="ppo_clip: dual-clip constant c > 1 bounding the loss of "
                                    "negative advantages at c * |A| (unset: off; gspo ignores it)")
    entropy_coef: float = Field(0.0, description="weight of the entropy bonus subtracted from the loss (0 = off, "
                                "and the entropy gets no gradient)")
    max_grad_norm: float = Field(1.0, gt=0, description="clip the global L2 norm of the gradients to this before "
                                 "each optimizer step")
    micro_batch_tokens: Annotated[int | Literal["auto"], int_or_auto(64)] = Field(
        "auto", description="padded tokens per micro-batch; auto: 8192 on the CPU, on CUDA from the device's free "
        "memory and the model's shape (agent_core/training/memory.py); a micro-batch that runs out of memory is split"
    )
    micro_batch_logits: Annotated[int | Literal["auto"], int_or_auto(2**16)] = Field(
        "auto", description="cap on tokens x vocab per micro-batch (its fp32 logits and their copies bound memory); "
        "auto: 2**26 on the CPU, none on CUDA (the memory-based budget counts the logits)"
    )
    loss_agg_mode: str = Field("token-mean", description="how per-token losses become one: token-mean over all "
                               "tokens, seq-mean-token-mean (each sequence weighs the same) or seq-mean-token-sum-norm "
                               "(Dr.GRPO: token sums over a fixed length)")
    policy_loss: str = Field("ppo_clip", description="a registered policy loss (agent_core/algos/losses.py)")
    policy_loss_options: dict[str, Any] = Field(default_factory=dict, description="the policy loss's own settings, "
                                                "checked by the settings model it was registered with (the built-in "
                                                "losses have none: their settings are the keys above)")
    objective: str = Field("ppo", description="a registered training objective: what an iteration's update does with "
                           "its sequences (agent_core/training/objectives.py; ppo: the clipped policy gradient, with "
                           "the critic when the estimator uses one)")
    objective_options: dict[str, Any] = Field(default_factory=dict, description="the training objective's own "
                                              "settings, checked by the settings model it was registered with (ppo "
                                              "has none: its settings are the keys of this section)")
    epochs: int = Field(1, ge=1, description="passes over an iteration's data")
    mini_batches: int = Field(2, ge=1, description="optimizer steps per epoch")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="the policy's learning rate after warm-up: constant, or a linear / cosine decay to 0 "
        "at total_steps (agent_core/training/schedule.py)")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    total_steps: int | None = Field(None, ge=1, description="decay horizon of linear/cosine (default: the run's)")
    recompute_old_logprobs: bool = Field(
        False, description="True: old log-probs from the policy before the update; False: the rollout's"
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16: forward/backward matmuls under bfloat16 autocast (weights, optimizer and loss stay "
        "fp32); ~2x faster on CPUs with AVX512-BF16 or AMX and on GPUs, log-probs differ at the 1e-2 level; auto: bf16 "
        "on CUDA, fp32 on the CPU (agent_core/training/precision.py)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations in the backward pass: less memory, ~30% more compute"
    )
    layout: Literal["auto", "step", "packed"] = Field(
        "auto", description="auto: packed episodes where contexts only append, step rows otherwise"
    )
    max_consecutive_nonfinite: int = Field(
        3, ge=0, description="optimizer steps in a row (counted across iterations) that may be skipped for non-finite "
        "inputs, log-probs, loss or gradients; one more stops the run before its checkpoint is written (0: the first)"
    )
