"""The metrics of one PPO optimizer step: ``UpdateResult`` (one row of `train_metrics`) and the
per-micro-batch sums it is made of (``Totals``), kept on the model's device until the step ends.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import torch

from agent_core.training.data_parallel import DataParallel
from agent_core.training.prepared import Prepared


@dataclass(frozen=True)
class UpdateResult:
    """Metrics of one optimizer step (one row of train_metrics).

    loss = pg_loss - entropy_coef * entropy term + kl_coef * KL term. entropy, kl and clipfrac are
    token means over the loss mask; kl is the configured estimator's KL to the reference when the
    sequences carry ref_logprobs, else the k3 estimate of KL(old || new). vf_loss: the critic's
    clipped value loss (nan without a critic). tokens: tokens in the loss mask; tokens_per_s: real
    (non-padding) tokens through the policy per second. skipped: a step of this update was not
    taken, skip_reason says which ("critic: ..." for the critic's). A skipped policy step leaves
    loss, pg_loss, entropy, kl and clipfrac nan; a skipped critic step leaves vf_loss nan (a
    taken policy step keeps its finite loss). oom_splits: micro-batches of this update that ran
    out of device memory and were split and retried (agent_core/training/oom.py).
    """

    loss: float
    pg_loss: float
    vf_loss: float
    entropy: float
    kl: float
    clipfrac: float
    grad_norm: float
    lr: float
    tokens: int
    tokens_per_s: float
    seconds: float
    skipped: bool
    skip_reason: str | None
    oom_splits: int = 0


@dataclass
class Totals:
    """Metric sums over a step's micro-batches, kept as tensors on the model's device (no host sync
    per micro-batch); ``summed`` reads them once (and adds them over ranks with `dp`)."""

    loss: torch.Tensor | float = 0.0
    pg_loss: torch.Tensor | float = 0.0
    vf_loss: torch.Tensor | float = 0.0
    entropy_sum: torch.Tensor | float = 0.0
    kl_sum: torch.Tensor | float = 0.0
    kl_tokens: torch.Tensor | float = 0.0
    clipped_sum: torch.Tensor | float = 0.0
    real_tokens: torch.Tensor | float = 0.0

    def restore(self, saved: "Totals") -> None:
        for name, value in vars(saved).items():
            setattr(self, name, value)

    def add(self, **values: torch.Tensor) -> None:
        for name, value in values.items():  # float64, as the Python floats these sums used to be
            setattr(self, name, getattr(self, name) + value.detach().to(torch.float64))

    def summed(self, dp: DataParallel | None) -> "Totals":
        """Plain floats (one host sync), over all ranks' micro-batches with `dp` (one collective), so
        metrics are the 1-worker ones."""
        fields = astuple(self)
        device = next((v.device for v in fields if torch.is_tensor(v)), "cpu")
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in fields]).tolist()
        return Totals(*values) if dp is None else Totals(*dp.sum_floats(values))


def update_result(totals: Totals, prep: Prepared, policy_skipped: bool, critic_skipped: bool, grad_norm: float,
            reasons: list[str], *, lr: float, seconds: float) -> UpdateResult:
    """The UpdateResult of one update from its (all ranks') totals."""
    tokens = math.nan if policy_skipped else prep.policy_norms.num_tokens
    return UpdateResult(
        loss=math.nan if policy_skipped else totals.loss,
        pg_loss=math.nan if policy_skipped else totals.pg_loss,
        vf_loss=math.nan if critic_skipped else totals.vf_loss,
        entropy=totals.entropy_sum / tokens,
        kl=math.nan if policy_skipped else totals.kl_sum / max(totals.kl_tokens, 1.0),
        clipfrac=totals.clipped_sum / tokens,
        grad_norm=grad_norm,
        lr=lr,
        tokens=int(prep.policy_norms.num_tokens),
        tokens_per_s=totals.real_tokens / seconds if seconds > 0 else math.nan,
        seconds=seconds,
        skipped=bool(reasons),
        skip_reason="; ".join(reasons) or None,
    )
