"""A two-choice multi-turn MDP whose expectations are exact finite sums (tests/test_unbiasedness.py).

From the start state the policy either ANSWERs at once (one step; right with probability
p_answer) or calls a TOOL first (a tool-call step, ``extra_tool_steps`` no-op tool-call steps,
then the answer step; right with probability p_tool). Every step earns ``step_reward`` (a process
reward); a right answer earns 1 more, on the answer step. Whether an answer is right is the
environment's coin: a right and a wrong episode have the same tokens, so the value of a prefix is
an expectation over that coin only (and, at the very first token, over the policy's choice).

A group is G episodes of one prompt. ``group_batches`` lists every composition of a group (how
many of each of the four episode kinds) and ``expected_first_advantages`` weighs each by its
multinomial probability, so an expectation over groups is an exact sum: no sampling, no tolerance.
Each composition is one batch of its own, so batch-level whitening sees one group (the harshest
case: its statistics move most with the composition).

Why the sign of E[A_0 | TOOL] - E[A_0 | ANSWER] is the test: with a policy that picks TOOL with
probability q = sigmoid(theta), d log pi(TOOL)/d theta = 1 - q and d log pi(ANSWER)/d theta = -q,
so the expected policy gradient on theta is q (1 - q) (E[A_0|TOOL] - E[A_0|ANSWER]); the true
gradient is q (1 - q) (V_TOOL - V_ANSWER). The first action is where the choice is made (its first
token differs between the two; its later tokens are determined by it).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from agent_core.algos.episodes import EpisodeLayout, EpisodeStep, build_episode_layout

PROMPT = (1, 2, 3)
TOOL_CALL = (10, 11, 12, 13)
NO_OP_CALL = (14, 15, 16, 17)
TOOL_OUTPUT = (30, 31)
ANSWER = (20, 21, 22)


@dataclass(frozen=True)
class EpisodeKind:
    tool: bool
    right: bool


KINDS = (EpisodeKind(False, True), EpisodeKind(False, False), EpisodeKind(True, True), EpisodeKind(True, False))


@dataclass(frozen=True)
class ToolMDP:
    p_answer: float = 0.3
    p_tool: float = 0.7
    step_reward: float = 0.0
    extra_tool_steps: int = 0

    @property
    def tool_steps(self) -> int:
        return 2 + self.extra_tool_steps

    def expected_return(self, tool: bool) -> float:
        """Worked by hand: V_TOOL = p_tool + (2 + k) c, V_ANSWER = p_answer + c."""
        if tool:
            return self.p_tool + self.tool_steps * self.step_reward
        return self.p_answer + self.step_reward

    def p_right(self, tool: bool) -> float:
        return self.p_tool if tool else self.p_answer

    def responses(self, tool: bool) -> list[tuple[int, ...]]:
        return [TOOL_CALL, *[NO_OP_CALL] * self.extra_tool_steps, ANSWER] if tool else [ANSWER]

    def steps(self, kind: EpisodeKind) -> list[EpisodeStep]:
        """The episode's steps, append-only (each prompt = the previous prompt + response + tool
        output), so tool-output tokens sit between the actions on the grid."""
        responses = self.responses(kind.tool)
        steps, prompt = [], list(PROMPT)
        for k, response in enumerate(responses):
            outcome = float(kind.right) if k == len(responses) - 1 else 0.0
            steps.append(EpisodeStep(list(prompt), list(response), self.step_reward + outcome))
            prompt = prompt + list(response) + list(TOOL_OUTPUT)
        return steps

    def anchors(self, kind: EpisodeKind) -> list[int]:
        """Per step, an id of the env state it starts from: 0 is the start state (every first
        step), j the state after j tool calls (the same for every TOOL episode)."""
        return list(range(len(self.responses(kind.tool))))

    def kind_probabilities(self, q: float) -> tuple[float, ...]:
        def probability(kind: EpisodeKind) -> float:
            right = self.p_right(kind.tool)
            return (q if kind.tool else 1 - q) * (right if kind.right else 1 - right)

        return tuple(probability(kind) for kind in KINDS)


@dataclass(frozen=True)
class GroupBatch:
    """One composition of a group: counts per kind (KINDS order), the episodes' kinds in row
    order, their grid and per-episode per-step anchor ids."""

    mdp: ToolMDP
    counts: tuple[int, ...]
    kinds: tuple[EpisodeKind, ...]
    layout: EpisodeLayout
    anchors: tuple[tuple[int, ...], ...]

    def anchor_grid(self) -> torch.Tensor:
        """int64 [E, T]: each step's anchor id at its step start, -1 elsewhere (``step_anchors``)."""
        grid = torch.full(tuple(self.layout.token_rewards.shape), -1, dtype=torch.long)
        for e, (spans, anchors) in enumerate(zip(self.layout.step_spans, self.anchors)):
            for span, anchor in zip(spans, anchors):
                grid[e, span.start] = anchor
        return grid

    def first_action_column(self, episode: int) -> int:
        return self.layout.step_spans[episode][0].start

    def probability(self, q: float) -> float:
        """Multinomial probability of this composition under a policy with P(TOOL) = q."""
        probs = self.mdp.kind_probabilities(q)
        size = sum(self.counts)
        coefficient = math.factorial(size) / math.prod(math.factorial(n) for n in self.counts)
        return coefficient * math.prod(p ** n for p, n in zip(probs, self.counts))

    def exact_values(self, q: float) -> torch.Tensor:
        """The MDP's exact value function on the grid (gamma = 1), float64 [E, T]: at column t, the
        expected sum of the rewards at columns >= t given the tokens before t. That is the outcome
        coin's expectation of the reward-to-go, except at the first action token, where the
        choice is still to be made: q V_TOOL + (1 - q) V_ANSWER."""
        rewards = self.layout.token_rewards.to(torch.float64).clone()
        for e, kind in enumerate(self.kinds):
            last = self.layout.step_spans[e][-1].response_end - 1
            rewards[e, last] += self.mdp.p_right(kind.tool) - float(kind.right)  # the coin's mean
        values = rewards.flip(-1).cumsum(-1).flip(-1)
        start_value = q * self.mdp.expected_return(True) + (1 - q) * self.mdp.expected_return(False)
        for e in range(len(self.kinds)):
            values[e, self.first_action_column(e)] = start_value
        return values


def compositions(group_size: int, parts: int = len(KINDS)):
    """Every tuple of `parts` non-negative counts summing to group_size."""
    for cuts in itertools.combinations(range(group_size + parts - 1), parts - 1):
        bounds = (-1, *cuts, group_size + parts - 1)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(parts))


@lru_cache(maxsize=None)
def group_batches(mdp: ToolMDP, group_size: int) -> tuple[GroupBatch, ...]:
    batches = []
    for counts in compositions(group_size):
        kinds = tuple(kind for kind, n in zip(KINDS, counts) for _ in range(n))
        layout = build_episode_layout([mdp.steps(kind) for kind in kinds])
        anchors = tuple(tuple(mdp.anchors(kind)) for kind in kinds)
        batches.append(GroupBatch(mdp, counts, kinds, layout, anchors))
    return tuple(batches)


@dataclass(frozen=True)
class ChoiceAdvantages:
    """E[A_0 | TOOL] and E[A_0 | ANSWER]: the expected advantage at the first action token."""

    tool: float
    answer: float

    @property
    def gap(self) -> float:
        return self.tool - self.answer


# advantages(batch, q) -> [E, T] advantages of the batch's episodes
AdvantageFn = Callable[[GroupBatch, float], torch.Tensor]


def expected_first_advantages(advantages: AdvantageFn, mdp: ToolMDP, q: float, group_size: int) -> ChoiceAdvantages:
    """Exact E[A_0 | choice] over groups of `group_size` episodes from a policy with P(TOOL) = q:
    sum over compositions of P(composition) * sum of the group's A_0 of that choice, divided by
    the expected number of such episodes in a group (G q or G (1 - q))."""
    tool_sum = answer_sum = total = 0.0
    for batch in group_batches(mdp, group_size):
        weight = batch.probability(q)
        total += weight
        if weight == 0.0:
            continue
        grid = advantages(batch, q)
        for e, kind in enumerate(batch.kinds):
            first = float(grid[e, batch.first_action_column(e)])
            if kind.tool:
                tool_sum += weight * first
            else:
                answer_sum += weight * first
    assert abs(total - 1.0) < 1e-12, f"composition probabilities sum to {total}"
    return ChoiceAdvantages(tool_sum / (group_size * q), answer_sum / (group_size * (1 - q)))
