"""The `reward:` section: the scorer and how rewards combine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agent_core.config._base import Section


class RewardConfig(Section):
    """The scorer, and how process and outcome rewards combine into the reward trained on (done once,
    at labelling: agent_core/rewards/combine.py)."""

    scorer: str = Field("qa_em", description="outcome scorer of a final answer: qa_em (exact match, 0/1) or qa_f1 "
                        "(token F1); a plugin may register more")
    format_weight: float = Field(0.1, ge=0, description="bonus for a well-formed final answer")
    process_weight: float = Field(1.0, ge=0, description="weight of the (normalized) process rewards")
    process_norm: Literal["none", "max_abs"] = Field(
        "none", description="max_abs: scale process rewards by the batch's largest absolute process return"
    )
