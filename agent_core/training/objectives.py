"""Training objectives: what one iteration's update does with its sequences, registered by name.

`trainer.objective` names one; "ppo" (the clipped policy-gradient update with an optional critic,
trainer.py) is the built-in. A plugin registers another objective on the same stored steps (an
advantage-weighted imitation, a distillation) with `@TRAINING_OBJECTIVES.register(name, settings=Model)`;
its `trainer.objective_options` arrive as the `options` object that model builds. The stage around it (loading,
checks for non-finite values, saving, the train_metrics table) is the same for every objective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

from agent_core.registry import Registry

if TYPE_CHECKING:  # config checks import this registry: the trainer itself loads only to train
    import torch

    from agent_core.training.batches import TrainSequence
    from agent_core.training.data_parallel import DataParallel
    from agent_core.training.settings import PPOSettings
    from agent_core.training.update_result import UpdateResult


class TrainingObjective(Protocol):
    """One iteration's update of `policy` (and `critic`, when the estimator uses one) on `sequences`;
    one UpdateResult per optimizer step, in order (the rows of train_metrics). options: the objective's
    own settings object (its registered model built from trainer.objective_options; None without one)."""

    def __call__(self, policy: torch.nn.Module, policy_optimizer: torch.optim.Optimizer,
                 sequences: Sequence[TrainSequence], settings: PPOSettings, *, options: Any, pad_id: int,
                 critic: torch.nn.Module | None, critic_optimizer: torch.optim.Optimizer | None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, seed: int,
                 dp: DataParallel | None) -> list[UpdateResult]: ...


TRAINING_OBJECTIVES: Registry[TrainingObjective] = Registry("training objective")


@TRAINING_OBJECTIVES.register("ppo")
def ppo(policy, policy_optimizer, sequences, settings, *, options=None, **kwargs):
    """PPO on the sequences (agent_core/training/trainer.py: train_iteration; its settings are `settings`)."""
    from agent_core.training.trainer import train_iteration  # the trainer loads only to train

    return train_iteration(policy, policy_optimizer, sequences, settings, **kwargs)
