"""The `algorithm:` section: the advantage estimator, masks and the KL term."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from agent_core.config._base import Section


class AlgorithmConfig(Section):
    """Estimator, masks (docs/architecture.md §3; what each does: agent_core/algos/masks.py) and the KL term."""

    estimator: str = Field("grpo", description="advantage estimator (agent_core/algos); gae and step_gae train a "
                           "critic too (the critic: section)")
    estimator_options: dict[str, Any] = Field(default_factory=dict, description="the estimator's own settings, "
                                              "checked by the settings model it was registered with (the built-in "
                                              "estimators have none: their settings are the keys below)")
    failed_episodes: Literal["exclude", "train"] = Field(
        "exclude", description="episodes that ended in an error (an agent program that crashed, hung or made no "
        "call; an env that raised): exclude = left out of training and of their group's baseline (the group's "
        "other episodes are compared among themselves); train = trained on with their reward (0 unless a process "
        "reward paid), as if the agent had failed the task. A step with no action is never trained on")
    norm_by_std: bool = Field(True, description="GRPO: divide by the group std (False = Dr.GRPO)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of future rewards (gae, step_gae, reinforce_pp, "
                         "gigpo's step returns); 1 = undiscounted, as episodes are short")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (gae, step_gae): lower trades variance for the "
                       "critic's bias")
    gigpo_omega: float = Field(1.0, ge=0, description="gigpo: weight of the anchor-state step advantage (0 = grpo)")
    eps: float = Field(1e-6, gt=0, description="added to a standard deviation before dividing by it (group "
                       "normalisation, whitening); numerical guard, rarely changed")
    whiten_advantages: bool = Field(True, description="gae, step_gae: whiten advantages over the advantage mask "
                                    "(verl, Agent-R1); others ignore it (reinforce_pp* always whiten, grpo/rloo never)")
    use_loss_mask: bool = Field(True, description="off = also train on observation tokens after the first prompt, "
                                "each with its own advantage (ablation)")
    use_advantage_mask: bool = Field(True, description="off = recursion and critic targets over observation tokens "
                                     "too (ablation; refused for grpo/rloo, where it changes nothing)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the frozen initial policy (0 = off)")
    kl_estimator: str = Field("k3", description="k1, k2 or k3 (Schulman's low-variance estimator)")
    kl_in_reward: bool = Field(False, description="True: subtract the KL from the reward; False: a loss term")
