"""Episode token layout and advantage estimators: hand-worked values, a plain reference, properties."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from agent_core.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageOutput, compute_advantages
from agent_core.algos.episodes import pack_step_rewards, unpack_steps
from agent_core.registry import UnknownNameError

# Six episodes in three groups (group ids need not be contiguous).
#   group 0: e0 one step (2 tokens, reward 1); e1 two steps (2 tokens, process reward 0.5;
#            3 tokens, outcome 1) -> score 1.5; e2 one step (1 token, reward 0)
#   group 1: e3 alone (2 tokens, reward 1)
#   group 7: e4 (1 token, reward 1); e5 (3 tokens, reward 0)
LENGTHS = [[2], [2, 3], [1], [2], [1], [3]]
REWARDS = [[1.0], [0.5, 1.0], [0.0], [1.0], [1.0], [0.0]]
GROUPS = torch.tensor([0, 0, 0, 1, 7, 7])
SCORES = [1.0, 1.5, 0.0, 1.0, 1.0, 0.0]


def per_token(values_per_episode: list[float], layout) -> list[list[float]]:
    """Each episode's value on its tokens, 0 on padding (the expected [E, T] grid)."""
    width = layout.mask.shape[1]
    return [
        [v] * sum(lengths) + [0.0] * (width - sum(lengths))
        for v, lengths in zip(values_per_episode, layout.step_lengths)
    ]


def test_pack_puts_each_step_reward_on_its_last_token():
    layout = pack_step_rewards(LENGTHS, REWARDS)
    assert layout.token_rewards.shape == (6, 5)
    assert layout.token_rewards[1].tolist() == [0.0, 0.5, 0.0, 0.0, 1.0]
    assert layout.token_rewards[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert layout.mask[1].tolist() == [1.0] * 5
    assert layout.mask[2].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert layout.token_rewards.sum(dim=1).tolist() == SCORES


def test_unpack_returns_per_step_token_lists():
    layout = pack_step_rewards(LENGTHS, REWARDS)
    steps = unpack_steps(layout.token_rewards, layout)
    assert steps[1] == [[0.0, 0.5], [0.0, 0.0, 1.0]]
    assert steps[2] == [[0.0]]
    assert [len(s) for s in steps[5]] == [3]


def test_empty_step_hands_its_reward_to_the_token_before():
    layout = pack_step_rewards([[2, 0]], [[0.25, 1.0]])
    assert layout.token_rewards.tolist() == [[0.0, 1.25]]
    assert unpack_steps(layout.token_rewards, layout) == [[[0.0, 1.25], []]]
    with pytest.raises(ValueError, match="episode 0 step 0"):
        pack_step_rewards([[0, 2]], [[1.0, 0.0]])


def test_pack_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="episode 1"):
        pack_step_rewards([[1], [1, 2]], [[0.0], [1.0]])


def test_grpo_hand_worked_values_with_unbiased_std():
    layout = pack_step_rewards(LENGTHS, REWARDS)
    out = compute_advantages("grpo", layout.token_rewards, layout.mask, GROUPS, eps=0.0)
    assert isinstance(out, AdvantageOutput)
    # group 0: mean 5/6, unbiased var = ((1/6)^2 + (2/3)^2 + (5/6)^2) / 2 = 7/12
    std0 = math.sqrt(7 / 12)
    # group 7: mean 1/2, unbiased std = sqrt(1/2) (the biased std would give +-1)
    std7 = math.sqrt(0.5)
    expected = [(1 / 6) / std0, (2 / 3) / std0, (-5 / 6) / std0, 0.0, 0.5 / std7, -0.5 / std7]
    assert torch.allclose(out.advantages, torch.tensor(per_token(expected, layout)), atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor(per_token(SCORES, layout)), atol=1e-6)


def test_grpo_without_std_only_centres():
    layout = pack_step_rewards(LENGTHS, REWARDS)
    out = compute_advantages("grpo", layout.token_rewards, layout.mask, GROUPS, norm_by_std=False)
    expected = [1 / 6, 2 / 3, -5 / 6, 0.0, 0.5, -0.5]
    assert torch.allclose(out.advantages, torch.tensor(per_token(expected, layout)), atol=1e-6)


def test_rloo_hand_worked_values():
    layout = pack_step_rewards(LENGTHS, REWARDS)
    out = compute_advantages("rloo", layout.token_rewards, layout.mask, GROUPS)
    # e0: 1 - (1.5 + 0)/2; e1: 1.5 - (1 + 0)/2; e2: 0 - (1 + 1.5)/2; e3 alone; e4: 1 - 0; e5: 0 - 1
    expected = [0.25, 1.0, -1.25, 0.0, 1.0, -1.0]
    assert torch.allclose(out.advantages, torch.tensor(per_token(expected, layout)), atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor(per_token(SCORES, layout)), atol=1e-6)


def reference(name: str, scores: list[float], groups: list[int], eps: float, norm_by_std: bool) -> list[float]:
    """Plain-Python per-episode advantages."""
    advantages = []
    for score, group in zip(scores, groups):
        members = [s for s, g in zip(scores, groups) if g == group]
        if len(members) == 1:
            advantages.append(0.0)
        elif name == "grpo":
            centred = score - statistics.mean(members)
            advantages.append(centred / (statistics.stdev(members) + eps) if norm_by_std else centred)
        else:
            advantages.append(score - (sum(members) - score) / (len(members) - 1))
    return advantages


@pytest.mark.parametrize("name, norm_by_std", [("grpo", True), ("grpo", False), ("rloo", True)])
@pytest.mark.parametrize("seed", range(5))
def test_torch_matches_plain_reference_on_random_batches(name, norm_by_std, seed):
    rng = random.Random(seed)
    num_episodes = rng.randint(1, 12)
    lengths = [[rng.randint(0, 4) + (k == 0) for k in range(rng.randint(1, 3))] for _ in range(num_episodes)]
    rewards = [[rng.choice([0.0, 1.0, rng.uniform(-1, 1)]) for _ in ep] for ep in lengths]
    groups = [rng.randint(0, 3) * 5 for _ in range(num_episodes)]
    layout = pack_step_rewards(lengths, rewards)
    out = compute_advantages(
        name, layout.token_rewards, layout.mask, torch.tensor(groups), eps=1e-6, norm_by_std=norm_by_std
    )
    scores = [sum(ep) for ep in rewards]
    expected = reference(name, scores, groups, 1e-6, norm_by_std)
    assert torch.allclose(out.advantages, torch.tensor(per_token(expected, layout)), atol=1e-4)
    assert torch.all(out.advantages[layout.mask == 0] == 0)
    assert torch.all(out.returns[layout.mask == 0] == 0)


def test_grpo_is_invariant_to_shifting_and_scaling_a_group():
    layout = pack_step_rewards(LENGTHS, REWARDS)
    base = compute_advantages("grpo", layout.token_rewards, layout.mask, GROUPS, eps=0.0)
    shift = torch.zeros_like(layout.token_rewards)
    for e, lengths in enumerate(layout.step_lengths):  # add 2 to every episode's return
        shift[e, sum(lengths) - 1] = 2.0
    scaled = compute_advantages("grpo", layout.token_rewards * 3.0 + shift, layout.mask, GROUPS, eps=0.0)
    assert torch.allclose(base.advantages, scaled.advantages, atol=1e-5)


def test_estimators_are_registered_and_unknown_names_list_the_valid_ones():
    assert {"grpo", "rloo"} <= set(ADVANTAGE_ESTIMATORS.names())
    layout = pack_step_rewards(LENGTHS, REWARDS)
    with pytest.raises(UnknownNameError, match="grpo.*rloo"):
        compute_advantages("gpro", layout.token_rewards, layout.mask, GROUPS)


def test_estimators_reject_mismatched_shapes():
    layout = pack_step_rewards(LENGTHS, REWARDS)
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages("grpo", layout.token_rewards, layout.mask, GROUPS[:3])
    with pytest.raises(ValueError, match="mask shape"):
        compute_advantages("rloo", layout.token_rewards, layout.mask[:, :2], GROUPS)
