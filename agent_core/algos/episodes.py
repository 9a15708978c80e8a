"""The episode token layout that advantage estimators work on.

Row e is episode e; its columns are the response tokens of all its steps, concatenated in step
order, then right padding. Observation (tool output) and prompt tokens are not columns: that is
the advantage-mask-on case of DESIGN.md §3, where the recursion of a token-level estimator skips
tool output. The advantage-mask-off ablation fits the same layout by passing, as a step's
"response length", its response plus observation token count (the reward still lands on the
step's last column, which is then the last observation token).

A step's reward sits on its last response token (the decision it rewards ended there), so an
episode's return is the sum of its row, and a token-level estimator sees process rewards where
they happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class EpisodeTokens:
    """Episodes as a padded token grid.

    token_rewards: float32 [E, T]; each step's reward on its last token, 0 elsewhere.
    mask: float32 [E, T]; 1 on real tokens, 0 on padding.
    step_lengths: per episode, the token count of each step (to split rows back into steps).
    """

    token_rewards: torch.Tensor
    mask: torch.Tensor
    step_lengths: tuple[tuple[int, ...], ...]


def pack_step_rewards(
    step_response_lengths: Sequence[Sequence[int]],
    step_rewards: Sequence[Sequence[float]],
) -> EpisodeTokens:
    """Lay out episodes of steps as rows of tokens with rewards on each step's last token.

    step_response_lengths[e][k], step_rewards[e][k]: token count and reward of step k of
    episode e. A step with no tokens has nowhere to carry its reward, so its reward is added to
    the last token before it (the policy's latest decision); a non-zero reward in an episode with
    no token before it raises ValueError.
    """
    if len(step_response_lengths) != len(step_rewards):
        raise ValueError(
            f"step_response_lengths has {len(step_response_lengths)} episodes but step_rewards "
            f"has {len(step_rewards)}"
        )
    lengths = tuple(tuple(int(n) for n in episode) for episode in step_response_lengths)
    for e, (episode_lengths, episode_rewards) in enumerate(zip(lengths, step_rewards)):
        if len(episode_lengths) != len(episode_rewards):
            raise ValueError(
                f"episode {e}: {len(episode_lengths)} step lengths but {len(episode_rewards)} rewards"
            )
        if any(n < 0 for n in episode_lengths):
            raise ValueError(f"episode {e}: negative step length in {list(episode_lengths)}")
    width = max((sum(episode) for episode in lengths), default=0)
    token_rewards = torch.zeros(len(lengths), width, dtype=torch.float32)
    mask = torch.zeros(len(lengths), width, dtype=torch.float32)
    for e, (episode_lengths, episode_rewards) in enumerate(zip(lengths, step_rewards)):
        end = 0
        for k, (n, reward) in enumerate(zip(episode_lengths, episode_rewards)):
            end += n
            if end == 0:
                if float(reward) != 0.0:
                    raise ValueError(
                        f"episode {e} step {k}: reward {reward} but no response token at or before "
                        f"this step to carry it"
                    )
                continue
            token_rewards[e, end - 1] += float(reward)
        mask[e, :end] = 1.0
    return EpisodeTokens(token_rewards=token_rewards, mask=mask, step_lengths=lengths)


def unpack_steps(values: torch.Tensor, layout: EpisodeTokens) -> list[list[list[float]]]:
    """Split a [E, T] tensor in the layout of `layout` into episode -> step -> per-token floats."""
    if values.dim() != 2 or values.shape[0] != len(layout.step_lengths):
        raise ValueError(
            f"values must be [E, T] with E = {len(layout.step_lengths)} episodes; got {tuple(values.shape)}"
        )
    rows = values.detach().to(torch.float64).cpu().tolist()
    episodes: list[list[list[float]]] = []
    for row, episode_lengths in zip(rows, layout.step_lengths):
        if sum(episode_lengths) > len(row):
            raise ValueError(f"values has {len(row)} columns, fewer than the episode's {sum(episode_lengths)} tokens")
        steps, start = [], 0
        for n in episode_lengths:
            steps.append(row[start : start + n])
            start += n
        episodes.append(steps)
    return episodes
