"""The `dev_eval:` section: held-out evaluation while training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agent_core.config._base import Section


class DevEvalConfig(Section):
    """Held-out evaluation while training: the policy answers the first `prompts` prompts of `split`
    (greedy, one episode each, with the rollout's budgets and tool format) before RL and after every
    `every`-th iteration; the EM goes into the iteration summary and MLflow (metric dev_em)."""

    every: int = Field(1, ge=0, description="evaluate after every N-th iteration (and the last); 0 = never")
    split: Literal["train", "dev", "test"] = Field(
        "dev", description="the split evaluated; test is for the final report, not for choosing settings")
    prompts: int = Field(200, ge=1, description="prompts of the split evaluated (the first N)")
