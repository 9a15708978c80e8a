"""The episode token grid that advantage estimators run on, and the way back to steps.

Row e is episode e's packed row (``agent_core.episodes.pack_steps``), aligned with a training row and a
critic's output. An append-only episode has observation columns between responses; others (e.g. last_k) only
have responses, so mask ablations act on append-only episodes only. A step's reward sits on its LAST ACTION
token. Run a critic on the grid with ``agent_core.algos.step_advantages.score_on_grid``.
Design notes: docs/architecture.md §11 (agent_core/algos/episodes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from agent_core.algos.masks import grid_advantage_mask
from agent_core.episodes import StepSpan, pack_steps


@dataclass(frozen=True)
class EpisodeStep:
    """One step as the grid needs it: the context it saw, what it generated, its reward (the
    combined reward of the rewards table)."""

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float


@dataclass(frozen=True)
class EpisodeLayout:
    """Episodes as a right-padded [E, T] grid (see the module docstring for what a row holds).

    token_rewards: float32, each step's reward on its last action token.
    action_mask: int64, 1 on response (policy-sampled) tokens.
    real_mask: int64, 1 on the response region (actions and observations after the first prompt),
    0 on the first prompt and on padding.
    step_starts: bool, True on the first action token of each step with a non-empty response.
    input_ids: int64, the row's token ids (first prompt included), 0 on padding.
    first_prompt_ids: per episode, the first step's prompt (the row's first columns).
    step_spans: per episode, per step, where the step's columns are.
    append_only: per episode, whether its observations are in the grid.
    """

    token_rewards: torch.Tensor
    action_mask: torch.Tensor
    real_mask: torch.Tensor
    step_starts: torch.Tensor
    input_ids: torch.Tensor
    first_prompt_ids: tuple[tuple[int, ...], ...]
    step_spans: tuple[tuple[StepSpan, ...], ...]
    append_only: tuple[bool, ...]

    @property
    def num_episodes(self) -> int:
        return len(self.step_spans)

    def row_length(self, episode: int) -> int:
        spans = self.step_spans[episode]
        return spans[-1].end if spans else 0

    def row_context(self, episode: int) -> list[int]:
        """The row's tokens (first prompt included): the sequence to run a critic / reference model
        on; its output at position t belongs to column t."""
        return self.input_ids[episode, : self.row_length(episode)].tolist()


class StepParts(NamedTuple):
    """A step's share of a [E, T] tensor: its response columns, then its observation columns."""

    response: list[float]
    observation: list[float]


def build_episode_layout(episodes: Sequence[Sequence[EpisodeStep]]) -> EpisodeLayout:
    """Lay out episodes (each a list of its steps in order) as the grid of ``EpisodeLayout``."""
    for e, steps in enumerate(episodes):
        if not steps:
            raise ValueError(f"episode {e} has no steps")
    rows = [pack_steps(steps) for steps in episodes]
    shape = (len(episodes), max((len(row) for row in rows), default=0))
    token_rewards = torch.zeros(shape, dtype=torch.float32)
    action_mask = torch.zeros(shape, dtype=torch.long)
    real_mask = torch.zeros(shape, dtype=torch.long)
    step_starts = torch.zeros(shape, dtype=torch.bool)
    input_ids = torch.zeros(shape, dtype=torch.long)
    for e, (steps, row) in enumerate(zip(episodes, rows)):
        input_ids[e, : len(row)] = torch.tensor(row.token_ids, dtype=torch.long)
        real_mask[e, row.prompt_length : len(row)] = 1
        last_action = -1
        for k, (step, span) in enumerate(zip(steps, row.spans)):
            action_mask[e, span.start : span.response_end] = 1
            if span.response_end > span.start:
                step_starts[e, span.start] = True
                last_action = span.response_end - 1
            if last_action >= 0:
                token_rewards[e, last_action] += float(step.reward)
            elif float(step.reward) != 0.0:
                raise ValueError(
                    f"episode {e} step {k}: reward {step.reward} but no action token at or before this step to carry it"
                )
    return EpisodeLayout(
        token_rewards=token_rewards,
        action_mask=action_mask,
        real_mask=real_mask,
        step_starts=step_starts,
        input_ids=input_ids,
        first_prompt_ids=tuple(tuple(int(t) for t in steps[0].prompt_ids) for steps in episodes),
        step_spans=tuple(row.spans for row in rows),
        append_only=tuple(row.append_only for row in rows),
    )


def advantage_mask(layout: EpisodeLayout, use_advantage_mask: bool) -> torch.Tensor:
    """The estimators' mask, float32 [E, T]: action tokens when on (default), every real token
    (actions and observations) when off (the docs/architecture.md §3 ablation; built by
    ``agent_core.algos.masks.grid_advantage_mask``)."""
    return grid_advantage_mask(layout.action_mask, layout.real_mask, use_advantage_mask)


def unpack(values: torch.Tensor, layout: EpisodeLayout) -> list[list[StepParts]]:
    """Split a [E, T] tensor on `layout`'s grid into episode -> step -> (response, observation)."""
    if values.dim() != 2 or values.shape[0] != layout.num_episodes:
        raise ValueError(
            f"values must be [E, T] with E = {layout.num_episodes} episodes; got {tuple(values.shape)}"
        )
    rows = values.detach().to(torch.float64).cpu().tolist()
    episodes = []
    for e, (row, spans) in enumerate(zip(rows, layout.step_spans)):
        if layout.row_length(e) > len(row):
            raise ValueError(f"values has {len(row)} columns, fewer than episode {e}'s {layout.row_length(e)} tokens")
        episodes.append([StepParts(row[s.start : s.response_end], row[s.response_end : s.end]) for s in spans])
    return episodes
