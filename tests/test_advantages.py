"""Advantage estimators: hand-worked values, plain-Python references on random batches, invariance."""

from __future__ import annotations

import math
import random
import statistics
import warnings

import pytest
import torch

from agent_core.algos import estimator_core
from agent_core.algos.estimator_core import (
    ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageOutput, GroupOfOneWarning, estimate_advantages,
)
from agent_core.algos.episodes import EpisodeStep, advantage_mask, build_episode_layout
from agent_core.registry import UnknownNameError

ALL_ESTIMATORS = ["gae", "step_gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]

# Six episodes in three groups (group ids need not be contiguous).
#   group 0: e0 one step (2 tokens, reward 1); e1 two steps (2 tokens, process reward 0.5;
#            3 tokens, outcome 1) -> score 1.5; e2 one step (1 token, reward 0)
#   group 1: e3 alone (2 tokens, reward 1)
#   group 7: e4 (1 token, reward 1); e5 (3 tokens, reward 0)
LENGTHS = [[2], [2, 3], [1], [2], [1], [3]]
REWARDS = [[1.0], [0.5, 1.0], [0.0], [1.0], [1.0], [0.0]]
GROUPS = torch.tensor([0, 0, 0, 1, 7, 7])
SCORES = [1.0, 1.5, 0.0, 1.0, 1.0, 0.0]


def responses_only(lengths, rewards):
    """A layout of episodes whose contexts are not append-only: rows hold the responses only."""
    return build_episode_layout(
        [[EpisodeStep([1], [5] * n, r) for n, r in zip(ep_lengths, ep_rewards)]
         for ep_lengths, ep_rewards in zip(lengths, rewards)]
    )


def grid(layout):
    return layout.token_rewards, advantage_mask(layout, True)


def per_token(values_per_episode, lengths):
    """[E, T] on the grid of ``responses_only``: column 0 is the first prompt [1], in no mask."""
    width = max(sum(ep) for ep in lengths)
    return torch.tensor([[0.0] + [v] * sum(ep) + [0.0] * (width - sum(ep))
                         for v, ep in zip(values_per_episode, lengths)])


# ---------------------------------------------------------------- grpo / rloo (hand-worked)

def test_grpo_hand_worked_values_with_unbiased_std():
    rewards, mask = grid(responses_only(LENGTHS, REWARDS))
    out = estimate_advantages("grpo", AdvantageInputs(rewards, mask, GROUPS, eps=0.0))
    assert isinstance(out, AdvantageOutput)
    # group 0: mean 5/6, unbiased var = ((1/6)^2 + (2/3)^2 + (5/6)^2) / 2 = 7/12
    std0 = math.sqrt(7 / 12)
    # group 7: mean 1/2, unbiased std = sqrt(1/2) (the biased std would give +-1)
    std7 = math.sqrt(0.5)
    expected = [(1 / 6) / std0, (2 / 3) / std0, (-5 / 6) / std0, 0.0, 0.5 / std7, -0.5 / std7]
    assert torch.allclose(out.advantages, per_token(expected, LENGTHS), atol=1e-6)
    assert torch.allclose(out.returns, per_token(SCORES, LENGTHS), atol=1e-6)


def test_grpo_without_std_only_centres():
    rewards, mask = grid(responses_only(LENGTHS, REWARDS))
    out = estimate_advantages("grpo", AdvantageInputs(rewards, mask, GROUPS, norm_by_std=False))
    expected = [1 / 6, 2 / 3, -5 / 6, 0.0, 0.5, -0.5]
    assert torch.allclose(out.advantages, per_token(expected, LENGTHS), atol=1e-6)


def test_rloo_hand_worked_values():
    rewards, mask = grid(responses_only(LENGTHS, REWARDS))
    out = estimate_advantages("rloo", AdvantageInputs(rewards, mask, GROUPS))
    # e0: 1 - (1.5 + 0)/2; e1: 1.5 - (1 + 0)/2; e2: 0 - (1 + 1.5)/2; e3 alone; e4: 1 - 0; e5: 0 - 1
    expected = [0.25, 1.0, -1.25, 0.0, 1.0, -1.0]
    assert torch.allclose(out.advantages, per_token(expected, LENGTHS), atol=1e-6)
    assert torch.allclose(out.returns, per_token(SCORES, LENGTHS), atol=1e-6)


def test_grpo_is_invariant_to_shifting_and_scaling_a_group():
    rewards, mask = grid(responses_only(LENGTHS, REWARDS))
    base = estimate_advantages("grpo", AdvantageInputs(rewards, mask, GROUPS, eps=0.0))
    shift = torch.zeros_like(rewards)
    for e, lengths in enumerate(LENGTHS):  # add 2 to every episode's return
        shift[e, sum(lengths)] = 2.0  # its last token: column 0 is the first prompt
    scaled = estimate_advantages("grpo", AdvantageInputs(rewards * 3.0 + shift, mask, GROUPS, eps=0.0))
    assert torch.allclose(base.advantages, scaled.advantages, atol=1e-5)


# ------------------------------------------- gae / step_gae (hand-worked, tool tokens between actions)
# Row 0: columns [a a o o a] (o = tool output); step 0 reward 0.5 on column 1, step 1 reward 1 on
# column 4. Row 1: [a a] reward 1 on column 1, then padding. gamma 0.9, lam 0.8 (gamma*lam 0.72).
TOOL_REWARDS = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0, 0.0]])
ACTIONS = torch.tensor([[1.0, 1, 0, 0, 1], [1, 1, 0, 0, 0]])
REAL = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
STARTS = torch.tensor([[True, False, False, False, True], [True, False, False, False, False]])
TOOL_VALUES = torch.tensor([[0.1, 0.2, 0.3, 0.35, 0.4], [0.5, 0.5, 0.0, 0.0, 0.0]])
PAIR = torch.tensor([0, 1])


def test_gae_mask_on_skips_tool_tokens_hand_worked():
    out = estimate_advantages("gae", AdvantageInputs(TOOL_REWARDS, ACTIONS, PAIR, TOOL_VALUES, gamma=0.9, lam=0.8))
    # row 0 over columns 0, 1, 4: A4 = 1 - 0.4 = 0.6
    # A1 = (0.5 + 0.9*0.4 - 0.2) + 0.72*0.6 = 0.66 + 0.432 = 1.092   (bootstraps from column 4)
    # A0 = (0 + 0.9*0.2 - 0.1) + 0.72*1.092 = 0.08 + 0.78624 = 0.86624
    # row 1: A1 = 1 - 0.5 = 0.5; A0 = (0.45 - 0.5) + 0.72*0.5 = 0.31
    expected = torch.tensor([[0.86624, 1.092, 0, 0, 0.6], [0.31, 0.5, 0, 0, 0]])
    assert torch.allclose(out.advantages, expected, atol=1e-6)
    assert torch.allclose(out.returns, (expected + TOOL_VALUES) * ACTIONS, atol=1e-6)


def test_gae_mask_off_runs_through_tool_tokens_hand_worked():
    out = estimate_advantages("gae", AdvantageInputs(TOOL_REWARDS, REAL, PAIR, TOOL_VALUES, gamma=0.9, lam=0.8))
    # A4 = 0.6; A3 = (0.9*0.4 - 0.35) + 0.72*0.6 = 0.442; A2 = (0.9*0.35 - 0.3) + 0.72*0.442 = 0.33324
    # A1 = (0.5 + 0.9*0.3 - 0.2) + 0.72*0.33324 = 0.8099328; A0 = 0.08 + 0.72*0.8099328 = 0.663151616
    expected_row0 = torch.tensor([0.663151616, 0.8099328, 0.33324, 0.442, 0.6])
    assert torch.allclose(out.advantages[0], expected_row0, atol=1e-6)
    assert torch.allclose(out.advantages[1], torch.tensor([0.31, 0.5, 0, 0, 0]), atol=1e-6)


def test_step_gae_hand_worked_mask_on_and_off():
    out = estimate_advantages(
        "step_gae", AdvantageInputs(TOOL_REWARDS, ACTIONS, PAIR, TOOL_VALUES, gamma=0.9, lam=0.8, step_starts=STARTS)
    )
    # row 0 steps: R0 = 0.5, V0 = 0.1 (column 0); R1 = 1, V1 = 0.4 (column 4)
    # A1 = 1 - 0.4 = 0.6; A0 = (0.5 + 0.9*0.4 - 0.1) + 0.72*0.6 = 0.76 + 0.432 = 1.192
    # row 1: one step, R = 1, V = 0.5 -> A = 0.5
    assert torch.allclose(out.advantages, torch.tensor([[1.192, 1.192, 0, 0, 0.6], [0.5, 0.5, 0, 0, 0]]), atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor([[1.292, 1.292, 0, 0, 1.0], [1.0, 1.0, 0, 0, 0]]), atol=1e-6)
    # mask off, with a reward of 0.25 on tool column 3: it joins step 0's reward (R0 = 0.75) and
    # the tool columns of step 0's segment get its advantage: A0 = 0.75 + 0.36 - 0.1 + 0.432
    rewards = TOOL_REWARDS.clone()
    rewards[0, 3] = 0.25
    off = estimate_advantages(
        "step_gae", AdvantageInputs(rewards, REAL, PAIR, TOOL_VALUES, gamma=0.9, lam=0.8, step_starts=STARTS)
    )
    assert torch.allclose(off.advantages[0], torch.tensor([1.442, 1.442, 1.442, 1.442, 0.6]), atol=1e-6)


def whitened(x, mask):
    """Plain reference: (x - mean) / std over the masked entries (unbiased std), 0 elsewhere."""
    picked = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean, std = statistics.mean(picked), statistics.stdev(picked)
    return (x - mean) / std * mask


@pytest.mark.parametrize("name", ["gae", "step_gae"])
def test_critic_estimators_whiten_advantages_over_the_mask_and_keep_returns_raw(name):
    for mask in (ACTIONS, REAL):
        kwargs = dict(gamma=0.9, lam=0.8, step_starts=STARTS, eps=0.0)
        raw = estimate_advantages(name, AdvantageInputs(TOOL_REWARDS, mask, PAIR, TOOL_VALUES, **kwargs))
        white = estimate_advantages(
            name, AdvantageInputs(TOOL_REWARDS, mask, PAIR, TOOL_VALUES, whiten=True, **kwargs)
        )
        assert torch.allclose(white.advantages, whitened(raw.advantages.double(), mask.double()).float(), atol=1e-6)
        assert torch.equal(white.returns, raw.returns)  # value targets are not whitened
    # by hand, gae with the mask on (advantages of test_gae_mask_on_skips_tool_tokens_hand_worked)
    if name == "gae":
        out = estimate_advantages(
            name, AdvantageInputs(TOOL_REWARDS, ACTIONS, PAIR, TOOL_VALUES, gamma=0.9, lam=0.8, whiten=True, eps=0.0)
        )
        five = [0.86624, 1.092, 0.6, 0.31, 0.5]
        mean, std = statistics.mean(five), statistics.stdev(five)
        assert out.advantages[0, 4].item() == pytest.approx((0.6 - mean) / std, abs=1e-5)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_a_group_of_one_gets_advantage_zero_and_one_warning(name, monkeypatch):
    monkeypatch.setattr(estimator_core, "_WARNED", set())
    rewards, mask = grid(responses_only([[1], [1], [2]], [[1.0], [0.0], [1.0]]))
    groups = torch.tensor([0, 0, 5])  # episode 2 is alone
    with pytest.warns(GroupOfOneWarning, match=f"{name}: 1 episode"):
        out = estimate_advantages(name, AdvantageInputs(rewards, mask, groups))
    assert out.advantages[2, 1:].tolist() == [0.0, 0.0] and out.returns[2, 1:].tolist() == [1.0, 1.0]
    assert out.advantages[0, 1] > 0 > out.advantages[1, 1]  # column 1: the first action token
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: a second batch with a group of one is silent
        estimate_advantages(name, AdvantageInputs(rewards, mask, groups))
        # no group of one: silent too
        estimate_advantages(name, AdvantageInputs(rewards, mask, torch.tensor([0, 0, 1])))


def test_critic_estimators_need_values_and_step_gae_needs_step_starts():
    for name in ("gae", "step_gae"):
        with pytest.raises(ValueError, match="needs a critic"):
            estimate_advantages(name, AdvantageInputs(TOOL_REWARDS, ACTIONS, PAIR, step_starts=STARTS))
    with pytest.raises(ValueError, match="step_starts"):
        estimate_advantages("step_gae", AdvantageInputs(TOOL_REWARDS, ACTIONS, PAIR, TOOL_VALUES))
    outside = STARTS.clone()
    outside[0, 2] = True  # a tool column
    with pytest.raises(ValueError, match="outside the mask"):
        estimate_advantages(
            "step_gae", AdvantageInputs(TOOL_REWARDS, ACTIONS, PAIR, TOOL_VALUES, step_starts=outside)
        )


# ---------------------------------------------------- reinforce_pp / reinforce_pp_baseline

def test_reinforce_pp_hand_worked():
    # e0 [a a o a], rewards 0.5 on column 1, 7 on the tool column (ignored), 1 on column 3;
    # e1 [a a] reward -1 on column 1. gamma 0.5.
    rewards = torch.tensor([[0.0, 0.5, 7.0, 1.0], [0.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 0, 1], [1, 1, 0, 0]])
    out = estimate_advantages("reinforce_pp", AdvantageInputs(rewards, mask, PAIR, gamma=0.5, eps=0.0))
    # G: e0 = [0 + 0.5*1.0, 0.5 + 0.5*1, -, 1] = [0.5, 1.0, -, 1.0]; e1 = [-0.5, -1]
    assert torch.allclose(out.returns, torch.tensor([[0.5, 1.0, 0, 1.0], [-0.5, -1.0, 0, 0]]))
    # five masked tokens: mean 0.2, squared deviations sum 3.3, unbiased var 3.3/4
    std = math.sqrt(3.3 / 4)
    expected = torch.tensor([[0.3, 0.8, 0, 0.8], [-0.7, -1.2, 0, 0]]) / std
    assert torch.allclose(out.advantages, expected, atol=1e-6)


def test_reinforce_pp_baseline_hand_worked():
    # e0, e1 in group 0 with scores 1.5 (3 tokens) and -1 (2 tokens); e2 alone (1 token, score 2)
    rewards = torch.tensor([[0.0, 0.5, 1.0], [0.0, -1.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    out = estimate_advantages(
        "reinforce_pp_baseline", AdvantageInputs(rewards, mask, torch.tensor([0, 0, 3]), eps=0.0)
    )
    # centred: e0 1.25, e1 -1.25, e2 keeps 2 (no group baseline); token mean = 3.25/6 = 13/24;
    # deviations 17/24, -43/24, 35/24; unbiased var = (3*17^2 + 2*43^2 + 35^2)/576/5 = 1158/576
    root = math.sqrt(1158)
    expected = torch.tensor([[17 / root] * 3, [-43 / root] * 2 + [0], [35 / root, 0, 0]])
    assert torch.allclose(out.advantages, expected, atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor([[1.5] * 3, [-1.0, -1.0, 0], [2.0, 0, 0]]))


# ------------------------------------------------------- plain-Python references, random batches

def ref_gae(rewards, mask, values, gamma, lam):
    advantages = [[0.0] * len(row) for row in rewards]
    for e, row in enumerate(rewards):
        columns = [t for t, m in enumerate(mask[e]) if m]
        following, running = 0.0, 0.0
        for t in reversed(columns):
            running = row[t] + gamma * following - values[e][t] + gamma * lam * running
            advantages[e][t] = running
            following = values[e][t]
    return advantages


def ref_step_gae(rewards, mask, values, starts, gamma, lam):
    advantages = [[0.0] * len(row) for row in rewards]
    for e, row in enumerate(rewards):
        begins = [t for t, s in enumerate(starts[e]) if s]
        segments = [range(b, begins[i + 1] if i + 1 < len(begins) else len(row)) for i, b in enumerate(begins)]
        following, running = 0.0, 0.0
        for segment in reversed(segments):
            step_reward = sum(row[t] for t in segment if mask[e][t])
            value = values[e][segment[0]]
            running = step_reward + gamma * following - value + gamma * lam * running
            following = value
            for t in segment:
                if mask[e][t]:
                    advantages[e][t] = running
    return advantages


def ref_whiten(grid, mask, eps):
    entries = [x for row, m_row in zip(grid, mask) for x, m in zip(row, m_row) if m]
    mean = sum(entries) / len(entries)
    std = statistics.stdev(entries) if len(entries) > 1 else 0.0
    return [[(x - mean) / (std + eps) if m else 0.0 for x, m in zip(row, m_row)] for row, m_row in zip(grid, mask)]


def ref_reinforce_pp(rewards, mask, gamma, eps):
    returns = [[0.0] * len(row) for row in rewards]
    for e, row in enumerate(rewards):
        running = 0.0
        for t in reversed([t for t, m in enumerate(mask[e]) if m]):
            running = row[t] + gamma * running
            returns[e][t] = running
    return ref_whiten(returns, mask, eps)


def ref_group_score(rewards, mask, groups, name, eps, norm_by_std):
    scores = [sum(r for r, m in zip(row, m_row) if m) for row, m_row in zip(rewards, mask)]
    per_episode = []
    for score, group in zip(scores, groups):
        members = [s for s, g in zip(scores, groups) if g == group]
        if len(members) == 1:
            per_episode.append(score if name == "reinforce_pp_baseline" else 0.0)
        elif name == "grpo":
            centred = score - statistics.mean(members)
            per_episode.append(centred / (statistics.stdev(members) + eps) if norm_by_std else centred)
        elif name == "rloo":
            per_episode.append(score - (sum(members) - score) / (len(members) - 1))
        else:
            per_episode.append(score - statistics.mean(members))
    broadcast = [[a if m else 0.0 for m in m_row] for a, m_row in zip(per_episode, mask)]
    return ref_whiten(broadcast, mask, eps) if name == "reinforce_pp_baseline" else broadcast


def random_batch(seed):
    rng = random.Random(seed)
    num_episodes, width = rng.randint(1, 8), rng.randint(1, 9)
    mask, starts = [], []
    for _ in range(num_episodes):
        length = rng.randint(1, width)
        row = [1 if t < length and (t == 0 or rng.random() < 0.7) else 0 for t in range(width)]
        mask.append(row)
        starts.append([bool(m) and (t == 0 or rng.random() < 0.3) for t, m in enumerate(row)])
    rewards = [[rng.choice([0.0, 1.0, rng.uniform(-1, 1)]) for _ in range(width)] for _ in range(num_episodes)]
    values = [[rng.uniform(-1, 1) for _ in range(width)] for _ in range(num_episodes)]
    groups = [rng.randint(0, 3) * 5 for _ in range(num_episodes)]
    gamma, lam = rng.choice([1.0, rng.uniform(0.5, 1)]), rng.choice([1.0, rng.uniform(0.5, 1)])
    return rewards, mask, values, starts, groups, gamma, lam


@pytest.mark.parametrize("name, norm_by_std", [(n, True) for n in ALL_ESTIMATORS] + [("grpo", False)])
@pytest.mark.parametrize("seed", range(8))
def test_torch_matches_plain_reference_on_random_batches(name, norm_by_std, seed):
    rewards, mask, values, starts, groups, gamma, lam = random_batch(seed)
    eps = 1e-6
    out = estimate_advantages(name, AdvantageInputs(
        torch.tensor(rewards), torch.tensor(mask), torch.tensor(groups), torch.tensor(values),
        gamma=gamma, lam=lam, eps=eps, norm_by_std=norm_by_std, step_starts=torch.tensor(starts),
    ))
    if name == "gae":
        expected = ref_gae(rewards, mask, values, gamma, lam)
    elif name == "step_gae":
        expected = ref_step_gae(rewards, mask, values, starts, gamma, lam)
    elif name == "reinforce_pp":
        expected = ref_reinforce_pp(rewards, mask, gamma, eps)
    else:
        expected = ref_group_score(rewards, mask, groups, name, eps, norm_by_std)
    assert torch.allclose(out.advantages, torch.tensor(expected, dtype=torch.float32), atol=1e-4)
    off = torch.tensor(mask) == 0
    assert torch.all(out.advantages[off] == 0) and torch.all(out.returns[off] == 0)


# ------------------------------------------------------------------------------ invariance

def tool_episode_layout():
    """Two groups of two append-only episodes with tool output between their actions."""
    def episode(first_response, observation, second_response, outcome):
        prompt = [1, 2]
        second_prompt = prompt + first_response + observation
        return [EpisodeStep(prompt, first_response, 0.1), EpisodeStep(second_prompt, second_response, outcome)]

    return build_episode_layout([
        episode([10, 11], [90, 91, 92], [12], 1.0),
        episode([10], [90], [13, 14], 0.0),
        episode([15, 16, 17], [93, 94], [18], 0.5),
        episode([19], [95, 96], [20, 21], -1.0),
    ])


@pytest.mark.parametrize("name", ALL_ESTIMATORS)
def test_observation_rewards_and_values_matter_only_with_the_mask_off(name):
    layout = tool_episode_layout()
    groups = torch.tensor([0, 0, 1, 1])
    values = torch.linspace(-0.5, 0.5, layout.token_rewards.numel()).reshape(layout.token_rewards.shape)
    observation = (layout.real_mask == 1) & (layout.action_mask == 0)
    assert observation.sum() == 8
    gaussian = torch.randn(layout.token_rewards.shape, generator=torch.Generator().manual_seed(0))
    noise = torch.where(observation, gaussian, 0.0)
    on_actions = layout.action_mask == 1

    def run(use_mask, perturb):
        return estimate_advantages(name, AdvantageInputs(
            layout.token_rewards + perturb * noise, advantage_mask(layout, use_mask), groups,
            values + perturb * noise, gamma=0.9, lam=0.95, step_starts=layout.step_starts,
            norm_by_std=False,  # with std, a group of two always gets +-1/sqrt(2): nothing could change
        )).advantages[on_actions]

    assert torch.equal(run(True, 0.0), run(True, 1.0))
    assert not torch.allclose(run(False, 0.0), run(False, 1.0), atol=1e-4)


# ------------------------------------------------------------------------------ registry, checks

def test_estimators_are_registered_and_unknown_names_list_the_valid_ones():
    assert set(ALL_ESTIMATORS) | {"gigpo"} == set(ADVANTAGE_ESTIMATORS.names())  # gigpo (step anchors): test_gigpo.py
    rewards, mask = grid(responses_only(LENGTHS, REWARDS))
    with pytest.raises(UnknownNameError, match="gae.*grpo.*rloo"):
        estimate_advantages("gpro", AdvantageInputs(rewards, mask, GROUPS))


def test_estimators_reject_mismatched_shapes():
    rewards, mask = grid(responses_only(LENGTHS, REWARDS))
    with pytest.raises(ValueError, match="group_index"):
        estimate_advantages("grpo", AdvantageInputs(rewards, mask, GROUPS[:3]))
    with pytest.raises(ValueError, match="mask shape"):
        estimate_advantages("rloo", AdvantageInputs(rewards, mask[:, :2], GROUPS))
    with pytest.raises(ValueError, match="values shape"):
        estimate_advantages("gae", AdvantageInputs(rewards, mask, GROUPS, torch.zeros(6, 2)))
