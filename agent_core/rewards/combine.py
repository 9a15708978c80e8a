"""The one place process and outcome rewards are combined: outcome + weighted, normalized process rewards.

Called once per iteration by reward labelling (``agent_core.rewards.labelling``); the rewards
table stores both components and the combined `reward`, and everything downstream (the
advantage estimators, the logged mean reward) reads that column.

Agent-R1 (arXiv 2511.14460) gives intermediate steps process rewards (e.g. a tool call that
failed) besides the outcome reward at the terminal step, and normalizes the process rewards
before combining the two so that dense shaping cannot outweigh the outcome (docs/architecture.md §7).
The paper does not fix the normalizer; ``"max_abs"`` here divides every process reward of the
batch by the largest absolute per-episode SUM of process rewards, so each episode's process
return lies in [-1, 1], the range of a typical outcome reward. Single steps may still exceed 1
in size when an episode's process rewards cancel out; the episode total is what competes with
the outcome. A batch whose process rewards are all 0 is left as is.
"""

from __future__ import annotations

from typing import Sequence

PROCESS_NORMALIZERS = ("none", "max_abs")


def _check_shapes(process: Sequence[Sequence[float]], outcome: Sequence[Sequence[float]]) -> None:
    if len(process) != len(outcome):
        raise ValueError(f"process rewards cover {len(process)} episodes but outcome rewards {len(outcome)}")
    for e, (process_steps, outcome_steps) in enumerate(zip(process, outcome)):
        if len(process_steps) != len(outcome_steps):
            raise ValueError(
                f"episode {e}: {len(process_steps)} process rewards but {len(outcome_steps)} outcome rewards"
            )
        early = [k for k, reward in enumerate(outcome_steps[:-1]) if float(reward) != 0.0]
        if early:
            raise ValueError(
                f"episode {e}: outcome reward on step(s) {early} before the last step "
                f"{len(outcome_steps) - 1}; an outcome belongs to the terminal step only"
            )


def process_scale(process: Sequence[Sequence[float]], normalize: str) -> float:
    """The factor every process reward of the batch is multiplied by under `normalize`."""
    if normalize not in PROCESS_NORMALIZERS:
        raise ValueError(f"unknown process reward normalizer {normalize!r}; valid: {', '.join(PROCESS_NORMALIZERS)}")
    if normalize == "none":
        return 1.0
    largest = max((abs(sum(float(r) for r in steps)) for steps in process), default=0.0)
    return 1.0 / largest if largest > 0 else 1.0


def process_factor(process: Sequence[Sequence[float]], *, process_weight: float, normalize: str) -> float:
    """What every process reward of the batch is multiplied by in the combined reward: the weight
    times the normalizer's scale (the rewards table stores it as `process_factor`)."""
    return process_weight * process_scale(process, normalize)


def combine_rewards(
    process: Sequence[Sequence[float]],
    outcome: Sequence[Sequence[float]],
    *,
    process_weight: float,
    normalize: str,
) -> list[list[float]]:
    """Per episode, per step: outcome + process_weight * normalized process reward.

    process[e][k], outcome[e][k]: rewards of step k of episode e (steps in order); the outcome
    may be non-zero on an episode's last step only. normalize: one of PROCESS_NORMALIZERS.
    """
    _check_shapes(process, outcome)
    factor = process_factor(process, process_weight=process_weight, normalize=normalize)
    return [
        [float(o) + factor * float(p) for p, o in zip(process_steps, outcome_steps)]
        for process_steps, outcome_steps in zip(process, outcome)
    ]
