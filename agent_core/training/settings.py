"""The settings of a PPO training iteration, one typed container built from the config in one place.

``train_iteration`` and ``ppo_update`` take a ``PPOSettings`` instead of two dozen keyword
arguments; the train stage builds it with ``PPOSettings.from_config``. It holds plain values
(a library caller or a test can make one without a config) and allows what the config forbids
for runs but a test needs: no gradient clipping (max_grad_norm None), an unclipped value loss
(value_clip None), a fixed seq-mean-token-sum-norm constant (norm_length).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent_core.algos.losses import POLICY_LOSSES
from agent_core.config import AlgorithmConfig, CriticConfig, TrainerConfig
from agent_core.training.memory import AUTO, Auto


@dataclass(frozen=True)
class PPOSettings:
    """What one PPO iteration does.

    Defaults are the config's (trainer.*, algorithm.*, rollout.temperature), except three, which are
    the library's own for a caller or test without a config (tests/test_ppo_settings_drift.py holds
    the list): mini_batches 1 (the config's 2 is the demo recipe's: two optimizer steps per pass),
    micro_batch_tokens 4096 and precision "fp32" (the config's "auto" resolves by device: 8,192
    tokens and fp32 on the CPU, memory-based and bf16 on CUDA; a fixed default keeps a bare
    PPOSettings the same on every machine). vf_coef and norm_length have no config key.

    epochs, mini_batches: passes over the data and optimizer steps per pass.
    clip_low, clip_high, dual_clip: the clipped surrogate (``agent_core.algos.losses``).
    policy_loss: the registered policy loss (``agent_core.algos.losses.POLICY_LOSSES``);
    policy_loss_options: its own settings object (trainer.policy_loss_options through the settings
    model it was registered with; None for one without).
    objective, objective_options: the registered training objective
    (``agent_core.training.objectives.TRAINING_OBJECTIVES``) and the options its settings model builds
    its settings object from (where it trains: agent_core/training/iteration.py).
    entropy_coef, kl_coef, kl_estimator: the entropy bonus and the KL-to-reference loss term.
    value_clip, vf_coef: the critic's clipped value loss and its weight (None: unclipped).
    max_grad_norm: gradient clipping (None: none). micro_batch_tokens: padded tokens per
    micro-batch, or "auto" (``agent_core.training.memory.resolve_micro_batch_tokens``: 8,192 on
    the CPU, from the device's free memory and the model's shape on CUDA); max_logit_elements caps
    tokens x vocabulary ("auto": 2**26 on the CPU, no cap on CUDA, whose budget counts the logits).
    temperature: the sampling temperature the log-probs are computed at.
    agg_mode: the loss aggregation (``LOSS_AGG_MODES``); norm_length: its seq-mean-token-sum-norm
    constant (None: the longest loss span of the update).
    use_loss_mask, use_advantage_mask: the mask ablations (``agent_core.algos.masks``).
    recompute_old_logprobs: old log-probs from the policy before the first step (else the rollout's).
    activation_checkpointing: the policy recomputes its layers' activations in the backward pass.
    precision: "fp32", "bf16" (the policy's and critic's forward passes under bfloat16 autocast), or
    "auto" (``agent_core.training.precision.resolve_precision``: bf16 on CUDA, fp32 on the CPU).
    """

    epochs: int = 1
    mini_batches: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    policy_loss: str = "ppo_clip"
    policy_loss_options: Any = None
    objective: str = "ppo"
    objective_options: Mapping[str, Any] = field(default_factory=dict)
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    value_clip: float | None = 0.2
    vf_coef: float = 1.0
    max_grad_norm: float | None = 1.0
    micro_batch_tokens: int | Auto = 4096
    max_logit_elements: int | Auto = AUTO
    temperature: float = 1.0
    agg_mode: str = "token-mean"
    norm_length: float | None = None
    use_loss_mask: bool = True
    use_advantage_mask: bool = True
    recompute_old_logprobs: bool = False
    activation_checkpointing: bool = False
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.mini_batches < 1:
            raise ValueError(f"epochs and mini_batches must be >= 1, got {self.epochs} and {self.mini_batches}")

    @classmethod
    def from_config(cls, trainer: TrainerConfig, algorithm: AlgorithmConfig, temperature: float | None,
                    critic: CriticConfig = CriticConfig()) -> "PPOSettings":
        """The run's settings: a KL in the reward was applied by the advantages stage, so it is no loss term."""
        return cls(
            epochs=trainer.epochs, mini_batches=trainer.mini_batches, clip_low=trainer.clip_low,
            clip_high=trainer.clip_high, dual_clip=trainer.dual_clip, policy_loss=trainer.policy_loss,
            policy_loss_options=POLICY_LOSSES.settings(trainer.policy_loss, trainer.policy_loss_options),
            objective=trainer.objective, objective_options=dict(trainer.objective_options),
            entropy_coef=trainer.entropy_coef, kl_coef=0.0 if algorithm.kl_in_reward else algorithm.kl_coef,
            kl_estimator=algorithm.kl_estimator, value_clip=critic.value_clip, max_grad_norm=trainer.max_grad_norm,
            micro_batch_tokens=trainer.micro_batch_tokens, max_logit_elements=trainer.micro_batch_logits,
            temperature=temperature or 1.0, agg_mode=trainer.loss_agg_mode, use_loss_mask=algorithm.use_loss_mask,
            use_advantage_mask=algorithm.use_advantage_mask, recompute_old_logprobs=trainer.recompute_old_logprobs,
            activation_checkpointing=trainer.activation_checkpointing, precision=trainer.precision,
        )
