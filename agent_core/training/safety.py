"""Numerical safety of training: why an update is skipped, when a run must stop, what may be saved.

A non-finite value anywhere in an update skips that optimizer step, and the skip reason names what was
non-finite. Before it writes anything the train stage calls ``check_nonfinite_updates`` and ``check_savable``;
either raises ``NonFiniteTrainingError``. Reasons are plain strings (stored in a table); a reason is a
non-finite one when it contains ``NONFINITE``. Functions here take plain values, never config objects.
Design notes: docs/architecture.md §11 (agent_core/training/safety.py).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

import torch

from agent_core.training.scoring import score_logprobs

NONFINITE = "non-finite"

# What each PaddedBatch tensor is called in a skip reason (where it came from, so it can be found).
_INPUT_NAMES = {
    "old_logprobs": "old log-probs (the rollout's response_logprobs, or the policy's when recomputed)",
    "advantages": "advantages",
    "ref_logprobs": "reference log-probs (ref_logprobs)",
    "old_values": "old values (the critic's, from the advantages table)",
    "returns": "returns",
}
POLICY_INPUTS = ("old_logprobs", "advantages", "ref_logprobs")
CRITIC_INPUTS = ("old_values", "returns")

_WHAT_TO_TRY = ("what to try: lower trainer.lr or trainer.max_grad_norm; check the advantages table for extreme "
                "values (e.g. a group std near 0 with norm_by_std); set trainer.recompute_old_logprobs=true when "
                "the rollout's log-probs disagree with the policy's; restart from the last finite checkpoint")


class NonFiniteTrainingError(RuntimeError):
    """Training produced non-finite values that skipping cannot fix; nothing of the iteration was saved."""


class SkipUpdate(Exception):
    """Raised inside a micro-batch to abandon the optimizer step before a backward pass; the message
    is the skip reason."""


def nonfinite_inputs(batches: Iterable, fields: Sequence[str]) -> str | None:
    """The skip reason when a tensor named in `fields` holds nan/inf in any batch, else None.

    The whole tensor is checked, not just the masked tokens: outside a mask a value is multiplied
    by 0, and nan * 0 is still nan. Counting per field tells a bad advantage from a bad log-prob.
    """
    named, found = [], []
    for batch in batches:
        for field in fields:
            values = getattr(batch, field)
            if values is not None:
                named.append(field)
                found.append((~torch.isfinite(values)).sum())
    counts: Counter[str] = Counter()
    for field, n in zip(named, torch.stack(found).tolist() if found else []):  # one host sync for all batches
        counts[field] += int(n)
    bad = [f"{_INPUT_NAMES.get(field, field)}: {n} values" for field, n in counts.items() if n]
    return f"{NONFINITE} inputs ({'; '.join(bad)})" if bad else None


def check_finite_output(values: torch.Tensor, attention_mask: torch.Tensor, what: str) -> None:
    """Raise SkipUpdate when a model output is nan/inf on a real (non-padding) token.

    Checked before the loss so the reason says the model is at fault (its weights or activations
    overflowed), not the data; padding positions are ignored (0 * nan there is not the model's).
    """
    real = attention_mask > 0
    bad = int((~torch.isfinite(values[real])).sum())
    if bad:
        raise SkipUpdate(f"{NONFINITE} {what} from the model on {bad} of {int(real.sum())} tokens "
                         "(its weights or activations overflowed)")


class FiniteWatch:
    """`check_finite_output` and the loss check of a step's micro-batches, counted on the device and read
    once, after the last micro-batch (`reason`): no host synchronisation per micro-batch. A non-finite
    micro-batch still runs its backward; its step is skipped all the same, before the optimizer sees it."""

    def __init__(self):
        self._outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # what -> (bad, real) token counts
        self._loss: torch.Tensor | None = None  # a non-finite loss seen, else 0

    def output(self, values: torch.Tensor, attention_mask: torch.Tensor, what: str) -> None:
        real = attention_mask > 0
        bad = (~torch.isfinite(values) & real).sum()
        before = self._outputs.get(what)
        self._outputs[what] = (bad, real.sum()) if before is None else (before[0] + bad, before[1] + real.sum())

    def loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float()
        before = torch.zeros_like(loss) if self._loss is None else self._loss
        self._loss = torch.where(torch.isfinite(loss), before, loss)

    def reason(self) -> str | None:
        """The skip reason (a model output first: the model is at fault, not the data), or None; one sync."""
        parts = [t for pair in self._outputs.values() for t in pair] + ([self._loss] if self._loss is not None else [])
        if not parts:
            return None
        values = torch.stack([t.to(parts[0].device, torch.float64) for t in parts]).tolist()
        for index, what in enumerate(self._outputs):
            bad, real = int(values[2 * index]), int(values[2 * index + 1])
            if bad:
                return (f"{NONFINITE} {what} from the model on {bad} of {real} tokens "
                        "(its weights or activations overflowed)")
        if self._loss is not None and not math.isfinite(values[-1]):
            return f"{NONFINITE} loss ({values[-1]}) in a micro-batch"
        return None


def is_nonfinite_skip(reason: str | None) -> bool:
    """A skip caused by nan/inf (the policy's or the critic's), not e.g. an update without loss tokens."""
    return reason is not None and NONFINITE in reason


def nonfinite_streaks(reasons: Sequence[str | None], carried: int = 0) -> tuple[int, int]:
    """(longest, trailing) runs of non-finite skips in `reasons`, the first run continuing `carried`
    skips from before (the previous iteration's trailing run)."""
    longest = current = carried
    for reason in reasons:
        current = current + 1 if is_nonfinite_skip(reason) else 0
        longest = max(longest, current)
    return longest, current


def check_nonfinite_updates(results: Sequence, *, iteration: int, max_consecutive: int, carried: int = 0) -> int:
    """Raise NonFiniteTrainingError when more than `max_consecutive` updates in a row were skipped
    for non-finite values; return the trailing run (to carry into the next iteration).

    results: the iteration's UpdateResults (anything with skip_reason, lr and grad_norm).
    carried: non-finite skips that ended the previous iteration. A few skips are a stray batch;
    a long run means the weights or the data are broken and more skipping only wastes rollouts.
    """
    reasons = [r.skip_reason for r in results]
    longest, trailing = nonfinite_streaks(reasons, carried)
    if longest <= max_consecutive:
        return trailing
    skipped = sum(is_nonfinite_skip(r) for r in reasons)
    causes = Counter(r for r in reasons if is_nonfinite_skip(r))
    listed = "; ".join(f"{n} x {reason!r}" for reason, n in causes.most_common(5))
    lrs = sorted({float(r.lr) for r in results})
    raise NonFiniteTrainingError(
        f"iteration {iteration}: {skipped} of {len(results)} updates were skipped for non-finite values"
        f"{f' (after {carried} at the end of the previous iteration)' if carried else ''}, {longest} in a row, "
        f"more than trainer.max_consecutive_nonfinite={max_consecutive}; no checkpoint was written. "
        f"Reasons: {listed}. Learning rate: {', '.join(f'{lr:g}' for lr in lrs)}. {_WHAT_TO_TRY}")


def nonfinite_parameters(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters that hold any nan/inf (a tied weight is listed under each name given)."""
    return [name for name, p in named_parameters if not bool(torch.isfinite(p.detach()).all())]


def check_savable(named_parameters: Iterable[tuple[str, torch.Tensor]], *, iteration: int, what: str = "policy",
                  probe_logprobs: Sequence[float] | None = None) -> None:
    """Raise NonFiniteTrainingError unless every parameter, and every probe log-prob, is finite.

    The last guard before a checkpoint is written: a checkpoint is read by the next rollout, by
    evaluation and by a resumed run, none of which can tell a broken one from a trained one.
    probe_logprobs: the updated model's log-probs of one training sequence (``probe_logprobs``);
    they catch weights that are finite but so large that the forward pass overflows.
    """
    bad = nonfinite_parameters(named_parameters)
    if bad:
        names = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise NonFiniteTrainingError(
            f"iteration {iteration}: the {what} has non-finite parameters after training ({names}); "
            f"its checkpoint was not written. {_WHAT_TO_TRY}")
    if probe_logprobs is not None:
        bad_probe = sum(not math.isfinite(x) for x in probe_logprobs)
        if bad_probe:
            raise NonFiniteTrainingError(
                f"iteration {iteration}: the {what}'s parameters are finite but its log-probs are not "
                f"({bad_probe} of {len(probe_logprobs)} tokens of a training sequence): the weights have "
                f"diverged; its checkpoint was not written. {_WHAT_TO_TRY}")


def probe_logprobs(model: torch.nn.Module, input_ids: Sequence[int], pad_id: int) -> list[float]:
    """The model's log-probs of one token sequence (no grad, eval mode): a cheap forward-pass sanity
    check before saving (use the shortest training sequence)."""
    return score_logprobs(model, [list(input_ids)], pad_id, max(64, len(input_ids)), 1.0)[0]
