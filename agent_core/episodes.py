"""One episode representation for every stage: steps grouped from table rows, and one token alignment.

Every stage that works per episode (reward labelling combines an episode's rewards, the advantages
stage lays episodes out as a token grid, training packs episodes into rows) gets its episodes from
``episodes_from_rows``, and every stage that lays an episode's tokens out in one row uses
``pack_steps``: position t of the row holds token t of the episode's sequence (first prompt,
step 0's response, its observation, step 1's response, ...), so a column index means the same
token in the advantages grid, in a critic's output and in a training row.

This module is pure Python (no torch, no I/O) so that any layer can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterable, Protocol, Sequence, TypeVar


class StepRow(Protocol):
    """What ``episodes_from_rows`` needs of a row: its episode, group and place in the episode."""

    episode_id: str
    group_id: str
    step_idx: int


class StepTokens(Protocol):
    """What ``pack_steps`` needs of a step: the context it saw and what it generated."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]


RowT = TypeVar("RowT", bound=StepRow)


@dataclass(frozen=True)
class Episode(Generic[RowT]):
    """One episode: its id, its group (the prompt it was sampled from) and its steps by step_idx."""

    episode_id: str
    group_id: str
    steps: tuple[RowT, ...]


def episodes_from_rows(rows: Iterable[RowT]) -> list[Episode[RowT]]:
    """Group rows (any order) into episodes, in the order each episode first appears.

    ValueError when an episode's step_idx do not run 0..n-1 or its steps disagree on group_id.
    """
    by_episode: dict[str, list[RowT]] = {}
    for row in rows:
        by_episode.setdefault(row.episode_id, []).append(row)
    episodes = []
    for episode_id, steps in by_episode.items():
        steps = sorted(steps, key=lambda s: s.step_idx)
        indices = [s.step_idx for s in steps]
        if indices != list(range(len(steps))):
            raise ValueError(f"episode {episode_id!r}: step_idx must run 0..{len(steps) - 1}; got {indices}")
        groups = sorted({s.group_id for s in steps})
        if len(groups) != 1:
            raise ValueError(f"episode {episode_id!r}: steps disagree on group_id: {groups}")
        episodes.append(Episode(episode_id, groups[0], tuple(steps)))
    return episodes


@dataclass(frozen=True)
class StepSpan:
    """Positions of one step in its episode's packed row: response [start, response_end),
    observation [response_end, end)."""

    start: int
    response_end: int
    end: int


@dataclass(frozen=True)
class PackedRow:
    """An episode's tokens in one row (token t at position t) and where each step sits in it.

    append_only: every step's prompt starts with the previous prompt + response, so the row is
    exactly the last step's context + response and the observations between responses are in it.
    Otherwise (e.g. a last_k context window) the row is the first prompt followed by the responses
    only: a layout to run an estimator on, not a sequence the policy saw (score such an episode
    step by step on each step's own prompt + response).
    """

    token_ids: tuple[int, ...]
    prompt_length: int  # the first prompt's tokens: the row's response region starts here
    spans: tuple[StepSpan, ...]
    append_only: bool

    def __len__(self) -> int:
        return len(self.token_ids)


def is_append_only(steps: Sequence[StepTokens]) -> bool:
    """True when every step's prompt starts with the previous step's prompt + response."""
    for previous, current in zip(steps, steps[1:]):
        context = list(previous.prompt_ids) + list(previous.response_ids)
        if list(current.prompt_ids[: len(context)]) != context:
            return False
    return True


def pack_steps(steps: Sequence[StepTokens]) -> PackedRow:
    """The packed row of an episode's steps (in step order); see ``PackedRow``."""
    if not steps:
        raise ValueError("an episode needs at least one step")
    append_only = is_append_only(steps)
    tokens = [int(t) for t in steps[0].prompt_ids]
    spans = []
    for k, step in enumerate(steps):
        start = len(tokens)
        tokens += [int(t) for t in step.response_ids]
        response_end = len(tokens)
        if append_only and k + 1 < len(steps):
            tokens += [int(t) for t in steps[k + 1].prompt_ids[response_end:]]
        spans.append(StepSpan(start, response_end, len(tokens)))
    return PackedRow(tuple(tokens), len(steps[0].prompt_ids), tuple(spans), append_only)
