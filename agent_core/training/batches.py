"""Training sequences, the two training layouts (step rows, packed episodes) and padded micro-batches.

A ``TrainSequence`` is one row of a policy update: token ids with, position for position, the action mask,
sampling log-probs and advantages, plus optional reference log-probs, values and returns. Layouts (chosen per
episode by ``choose_layout``): step rows (one row per agent step) or packed (an append-only episode in one
row). Position t holds values for token t itself (its log-prob given tokens < t); nothing is shifted here.
Design notes: docs/architecture.md §11 (agent_core/training/batches.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from agent_core.algos.masks import action_mask_for_step, first_action_index
from agent_core.episodes import is_append_only, pack_steps

LAYOUTS = ("auto", "step", "packed")
_OPTIONAL_FIELDS = ("ref_logprobs", "old_values", "returns")


@dataclass(frozen=True)
class TrainSequence:
    """One training row; every list has the same length L (optional lists: None when not used)."""

    input_ids: list[int]
    action_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    ref_logprobs: list[float] | None = None
    old_values: list[float] | None = None
    returns: list[float] | None = None
    response_start: int | None = None  # None: the first action token

    def __post_init__(self) -> None:
        required = ("input_ids", "action_mask", "old_logprobs", "advantages")
        lengths = {name: len(getattr(self, name)) for name in required}
        lengths.update({name: len(getattr(self, name)) for name in _OPTIONAL_FIELDS if getattr(self, name) is not None})
        if len(set(lengths.values())) != 1:
            raise ValueError(f"TrainSequence fields disagree in length: {lengths}")
        if not self.input_ids:
            raise ValueError("TrainSequence is empty (no input_ids)")
        if self.response_start is not None and not 1 <= self.response_start <= len(self.input_ids):
            raise ValueError(f"response_start {self.response_start} is not in 1..{len(self.input_ids)} "
                             "(the first token has no context)")

    @property
    def region_start(self) -> int:
        """Where the response region starts (``response_start``, else the first action token)."""
        return first_action_index(self.action_mask) if self.response_start is None else self.response_start

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TrainStep:
    """What training needs of one agent step (a `steps` row joined with its `advantages` row).

    Response-aligned lists have one entry per response token; ref_logprobs/values/returns are None
    when not computed. obs_* cover the observation tokens after the response (None: not stored).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    advantages: list[float]
    ref_logprobs: list[float] | None = None
    values: list[float] | None = None
    returns: list[float] | None = None
    obs_advantages: list[float] | None = None
    obs_returns: list[float] | None = None
    obs_values: list[float] | None = None
    episode_id: str = ""
    group_id: str = ""
    step_idx: int = 0


def _check_step_lengths(response_ids, response_logprobs, advantages, **optional) -> None:
    lengths = {"response_logprobs": len(response_logprobs), "advantages": len(advantages)}
    lengths.update({name: len(v) for name, v in optional.items() if v is not None})
    if set(lengths.values()) != {len(response_ids)}:
        others = ", ".join(f"{name} {n}" for name, n in lengths.items())
        raise ValueError(f"step lengths disagree: response_ids has {len(response_ids)} tokens, {others}")


def _floats(values: Sequence[float] | None) -> list[float]:
    return [] if values is None else [float(x) for x in values]


def step_sequence(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    response_logprobs: Sequence[float],
    advantages: Sequence[float],
    *,
    ref_logprobs: Sequence[float] | None = None,
    values: Sequence[float] | None = None,
    returns: Sequence[float] | None = None,
    prompt_suffix: "ObservationValues | None" = None,
) -> TrainSequence:
    """The training row of one agent step: prompt + response, with the action on the response.

    prompt_suffix: the previous step's observation values, placed on the last prompt tokens; the
    row's response region starts there (else at the response).
    """
    _check_step_lengths(response_ids, response_logprobs, advantages, ref_logprobs=ref_logprobs, values=values,
                        returns=returns)
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: a step needs at least one prompt token")
    prompt_len = len(prompt_ids)
    suffix = prompt_suffix or ObservationValues([], [], [])
    if len(suffix) >= prompt_len:
        raise ValueError(f"{len(suffix)} observation values do not fit in a prompt of {prompt_len} tokens "
                         "(the first prompt token takes none)")
    head = [0.0] * (prompt_len - len(suffix))
    return TrainSequence(
        input_ids=[int(t) for t in prompt_ids] + [int(t) for t in response_ids],
        action_mask=action_mask_for_step(prompt_len, len(response_ids)).tolist(),
        old_logprobs=[0.0] * prompt_len + _floats(response_logprobs),
        advantages=head + suffix.advantages + _floats(advantages),
        ref_logprobs=None if ref_logprobs is None else [0.0] * prompt_len + _floats(ref_logprobs),
        old_values=None if values is None else head + suffix.values + _floats(values),
        returns=None if returns is None else head + suffix.returns + _floats(returns),
        response_start=len(head),
    )


@dataclass(frozen=True)
class ObservationValues:
    """Advantages/returns/values of an observation span (zeros where a list was not stored)."""

    advantages: list[float]
    returns: list[float]
    values: list[float]

    def __len__(self) -> int:
        return len(self.advantages)

    @staticmethod
    def of(step: TrainStep, span: int, where: str) -> "ObservationValues":
        """The step's obs_* lists for an observation of `span` tokens (zeros when not stored)."""
        stored = {n: getattr(step, n) for n in ("obs_advantages", "obs_returns", "obs_values")}
        for name, values in stored.items():
            if values is not None and len(values) not in (0, span):
                raise ValueError(f"{where}: {name} has {len(values)} entries but the observation has {span} tokens")
        pick = lambda v: _floats(v) if v else [0.0] * span  # noqa: E731
        return ObservationValues(
            pick(stored["obs_advantages"]), pick(stored["obs_returns"]), pick(stored["obs_values"])
        )


def episode_step_sequences(steps: Sequence[TrainStep]) -> list[TrainSequence]:
    """Step-row layout of one episode: one row per step; step k's obs_* go on step k+1's prompt suffix.

    The suffix is the last len(obs_*) prompt tokens, which holds for append-only contexts and for
    context managers that trim only older turns; obs_* of the last step have no row and are dropped.
    """
    rows = []
    for k, step in enumerate(steps):
        suffix = None
        previous = steps[k - 1] if k > 0 else None
        if previous is not None and (previous.obs_advantages or previous.obs_returns or previous.obs_values):
            span = len(previous.obs_advantages or previous.obs_returns or previous.obs_values)
            suffix = ObservationValues.of(previous, span, where=f"step {k - 1}")
        rows.append(step_sequence(step.prompt_ids, step.response_ids, step.response_logprobs, step.advantages,
                                  ref_logprobs=step.ref_logprobs, values=step.values, returns=step.returns,
                                  prompt_suffix=suffix))
    return rows


def episode_sequence(steps: Sequence[TrainStep]) -> TrainSequence:
    """Packed layout: one row for an append-only episode (steps in step_idx order).

    input_ids = the episode's packed row (``agent_core.episodes.pack_steps``: the last step's
    prompt + response); each step's response span carries its action mask, log-probs, advantages
    (and ref log-probs, values, returns when every step has them); each observation span between
    two responses carries the earlier step's obs_* (0 if absent).
    """
    if not steps:
        raise ValueError("episode_sequence needs at least one step")
    row = pack_steps(steps)
    if not row.append_only:
        raise ValueError("episode is not append-only (a step's prompt does not start with the previous prompt + "
                         "response): use the 'step' or 'auto' layout")
    use = {name: all(getattr(s, name) is not None for s in steps) for name in ("ref_logprobs", "values", "returns")}
    for name, present in use.items():
        if not present and any(getattr(s, name) is not None for s in steps):
            raise ValueError(f"{name} is given for some steps of the episode but not for others")
    width = len(row)
    mask = [0] * width
    columns = {name: [0.0] * width for name in ("old_logprobs", "advantages", "ref_logprobs", "values", "returns")}
    for k, (step, span) in enumerate(zip(steps, row.spans)):
        _check_step_lengths(step.response_ids, step.response_logprobs, step.advantages, ref_logprobs=step.ref_logprobs,
                            values=step.values, returns=step.returns)
        response, observation = slice(span.start, span.response_end), slice(span.response_end, span.end)
        mask[response] = [1] * (span.response_end - span.start)
        columns["old_logprobs"][response] = _floats(step.response_logprobs)
        columns["advantages"][response] = _floats(step.advantages)
        for name in ("ref_logprobs", "values", "returns"):
            if use[name]:
                columns[name][response] = _floats(getattr(step, name))
        if k + 1 < len(steps):
            stored = ObservationValues.of(step, span.end - span.response_end, where=f"step {k}")
            columns["advantages"][observation] = stored.advantages
            columns["values"][observation] = stored.values
            columns["returns"][observation] = stored.returns
    return TrainSequence(
        input_ids=list(row.token_ids), action_mask=mask, old_logprobs=columns["old_logprobs"],
        advantages=columns["advantages"], ref_logprobs=columns["ref_logprobs"] if use["ref_logprobs"] else None,
        old_values=columns["values"] if use["values"] else None,
        returns=columns["returns"] if use["returns"] else None,
        response_start=row.prompt_length,
    )


def choose_layout(episodes: Sequence[Sequence[TrainStep]], layout: str = "auto") -> list[TrainSequence]:
    """Training rows for episodes (each a list of steps in step_idx order), by layout name.

    "auto": packed for append-only episodes, step rows for the others (per episode).
    "step": step rows for every episode. "packed": packed for every episode; a non-append-only
    episode is an error (naming its position in `episodes`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown training layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    rows: list[TrainSequence] = []
    for index, steps in enumerate(episodes):
        if not steps:
            raise ValueError(f"episode {index} has no steps")
        append_only = is_append_only(steps)
        if layout == "packed" and not append_only:
            raise ValueError(f"layout 'packed' needs append-only episodes, but episode {index} is not (a step's "
                             "prompt does not start with the previous prompt + response); use 'auto' or 'step'")
        if layout != "step" and append_only:
            rows.append(episode_sequence(steps))
        else:
            rows.extend(episode_step_sequences(steps))
    return rows


@dataclass(frozen=True)
class PaddedBatch:
    """Right-padded micro-batch, all tensors [B, L].

    input_ids, attention_mask, action_mask: int64. old_logprobs, advantages and the optional
    ref_logprobs, old_values, returns: float32, 0 on padding (None when the sequences have none).
    response_start: int64 [B], where each row's response region starts (``TrainSequence.region_start``).
    indices: position of each row in the list given to ``make_micro_batches``.
    row_loss_targets: per row, how many of its tokens get logits under the loss mask (set by
    ``prepared.prepare_update`` from the masks on the host), so the selective LM head needs no host sync.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    indices: tuple[int, ...]
    response_start: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    row_loss_targets: tuple[int, ...] | None = None

    @property
    def loss_targets(self) -> int | None:
        """Tokens of the whole batch that get logits under the loss mask (None: not counted)."""
        return None if self.row_loss_targets is None else sum(self.row_loss_targets)

    def to(self, device: torch.device | str) -> "PaddedBatch":
        moved = {name: getattr(self, name) for name in ("input_ids", "attention_mask", "action_mask", "old_logprobs",
                                                         "advantages", "response_start", *_OPTIONAL_FIELDS)}
        return replace(self, **{k: None if v is None else v.to(device) for k, v in moved.items()})


def _float_column(sequences: list[TrainSequence], name: str, width: int) -> torch.Tensor | None:
    present = [getattr(s, name) is not None for s in sequences]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"{name} is given for some training sequences but not for others; give it for all or none")
    column = torch.zeros((len(sequences), width), dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        column[row, : len(sequence)] = torch.tensor(getattr(sequence, name), dtype=torch.float32)
    return column


def pad_sequences(sequences: list[TrainSequence], indices: tuple[int, ...], pad_id: int) -> PaddedBatch:
    """One right-padded batch of `sequences` (indices: their positions in the caller's list)."""
    width = max(len(s) for s in sequences)
    shape = (len(sequences), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    action_mask = torch.zeros(shape, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        n = len(sequence)
        input_ids[row, :n] = torch.tensor(sequence.input_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        action_mask[row, :n] = torch.tensor(sequence.action_mask, dtype=torch.long)
    floats = {name: _float_column(sequences, name, width) for name in ("old_logprobs", "advantages", *_OPTIONAL_FIELDS)}
    response_start = torch.tensor([s.region_start for s in sequences], dtype=torch.long)
    return PaddedBatch(input_ids, attention_mask, action_mask, indices=indices, response_start=response_start,
                       **floats)


def token_budget_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that each group's rows * longest length stays <= max_tokens.

    Longest first (less padding), filled greedily; a single length above max_tokens gets a group
    of its own. Every index lands in exactly one group.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    groups: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * width > max_tokens:
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    return groups


def make_micro_batches(sequences: Sequence[TrainSequence], *, max_tokens: int, pad_id: int) -> list[PaddedBatch]:
    """Right-padded micro-batches of at most `max_tokens` padded tokens (see ``token_budget_groups``)."""
    groups = token_budget_groups([len(s) for s in sequences], max_tokens)
    return [pad_sequences([sequences[i] for i in group], tuple(group), pad_id) for group in groups]
