"""The `critic:` section: the value model that `algorithm.estimator: gae` and `step_gae` train
beside the policy (initialised from the start policy with a value head; agent_core/training)."""

from __future__ import annotations

from pydantic import Field

from agent_core.config._base import Section


class CriticConfig(Section):
    """The critic's own optimizer and value loss (its weight decay is trainer.weight_decay, shared
    with the policy's optimizer). Estimators without values ignore this section."""

    lr: float = Field(1e-4, gt=0, description="the critic's learning rate (gae, step_gae)")
    value_clip: float = Field(0.2, gt=0, description="clip range of the value loss: a new value is kept within "
                              "value_clip of the rollout's old value (PPO's clipped value loss)")
