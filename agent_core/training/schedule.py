"""Learning-rate schedules by name, with linear warmup, as torch ``LambdaLR`` factories.

``LR_SCHEDULES``: "constant", "linear" (decay to min_lr_ratio * base_lr at total_steps) and
"cosine" (half cosine to min_lr_ratio * base_lr at total_steps); each starts with `warmup_steps`
of linear warmup from base_lr / warmup_steps. After total_steps the rate stays at its floor.

Across iterations: every pipeline iteration builds a fresh optimizer and scheduler, so the step
count must come from outside. The caller passes ``start_step`` = the number of optimizer steps
taken in earlier iterations, which the optimizer state it restores already records
(``optimizer_step_count``: AdamW's per-parameter "step"; skipped updates do not count, and the
trainer steps the scheduler only after a taken step, so both counts agree). The multiplier of
step s is f(start_step + s), independent of any ``initial_lr`` left in a restored optimizer state:
the base rate is always the `base_lr` passed here (the config's).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from agent_core.registry import Registry

Decay = Callable[[float], float]  # progress in [0, 1] after warmup -> multiplier in [0, 1]

LR_SCHEDULES: Registry[Decay] = Registry("learning-rate schedule")


@LR_SCHEDULES.register("constant")
def _constant(progress: float) -> float:
    return 1.0


@LR_SCHEDULES.register("linear")
def _linear(progress: float) -> float:
    return 1.0 - progress


@LR_SCHEDULES.register("cosine")
def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_multiplier(step: int, *, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """The factor on base_lr at optimizer step `step` (0-based) of the named schedule."""
    decay = LR_SCHEDULES.get(name)
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"warmup_steps must be >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay(progress)


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    name: str,
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    start_step: int = 0,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A LambdaLR whose rate at its own step s is base_lr * lr_multiplier(start_step + s).

    Sets every param group's lr to the rate of `start_step` right away (the first update uses it).
    """
    lr_multiplier(start_step, name=name, warmup_steps=warmup_steps, total_steps=total_steps,
                  min_lr_ratio=min_lr_ratio)  # validates the arguments before torch sees them
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    for group in optimizer.param_groups:
        group["lr"] = base_lr
        group["initial_lr"] = base_lr
    return LambdaLR(optimizer, lambda s: lr_multiplier(start_step + s, name=name, warmup_steps=warmup_steps,
                                                       total_steps=total_steps, min_lr_ratio=min_lr_ratio))


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps recorded in the optimizer's state (Adam/AdamW "step"); 0 for a fresh one."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0
