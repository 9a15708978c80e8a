"""Per-token KL estimators to a frozen reference policy (docs/architecture.md §7), pure torch, by name.

Each estimator maps the log-probs of the sampled tokens under the current policy (``logprobs``)
and under the reference (``ref_logprobs``), both [B, L], to a per-token estimate [B, L] of
KL(pi || pi_ref) (Schulman, "Approximating KL divergence", 2020). With ``log_r = ref - logp``:

- ``k1`` = logp - ref = -log_r: unbiased, high variance, can be negative per token.
- ``k2`` = 0.5 * (logp - ref)^2: biased (low for a small KL), low variance, never negative.
- ``k3`` = exp(log_r) - log_r - 1: unbiased AND never negative (the "low-variance" one).

The same numbers serve a KL term in the loss (the trainer) or a KL penalty in the reward (the
advantages stage); the caller masks and aggregates.

Where this differs from the plain formulas: k3 clamps log_r to [-MAX_KL_LOG_RATIO,
MAX_KL_LOG_RATIO] before exp, because one stale or garbage log-prob would otherwise overflow
float32 to inf and turn a whole update into nan. Inside the clamp the value is exact; beyond it,
the gradient is 0 for that token (the penalty saturates at about 4.9e8 rather than exploding).
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
