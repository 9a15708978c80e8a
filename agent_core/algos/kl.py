"""Per-token KL estimators to a frozen reference policy (docs/architecture.md §7), pure torch, by name.

Each maps ``logprobs`` and ``ref_logprobs`` [B, L] to a per-token estimate of KL(pi || pi_ref) (Schulman
2020): ``k1`` (unbiased, may be negative), ``k2`` (biased, low variance), ``k3`` (unbiased, never negative);
the caller masks and aggregates. Differs from the plain formulas: k3 clamps log_r to +-MAX_KL_LOG_RATIO before
exp (no float32 overflow to inf; beyond the clamp the token's gradient is 0).
Design notes: docs/architecture.md §11 (agent_core/algos/kl.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from agent_core.registry import Registry

MAX_KL_LOG_RATIO = 20.0

KlEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KlEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_logprobs - logprobs).clamp(-MAX_KL_LOG_RATIO, MAX_KL_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate [B, L] of the named estimator (``KL_ESTIMATORS``: k1, k2, k3)."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            "logprobs and ref_logprobs must share one shape; got "
            f"{tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}"
        )
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
