"""Episode token grid (append-only and responses-only), reward combination, and the stage entry point.

The grid's columns are positions in the episode's packed row (``agent_core.episodes.pack_steps``):
the first prompt [1, 2] takes columns 0 and 1 and is in no mask."""

from __future__ import annotations

import pytest
import torch

from agent_core.algos.episodes import EpisodeStep, advantage_mask, build_episode_layout, unpack
from agent_core.algos.step_advantages import (
    StepRewardRow,
    carry_into_observations,
    estimate_step_advantages,
    prepare_episodes,
)
from agent_core.episodes import StepSpan
from agent_core.rewards.combine import combine_rewards

# Append-only: step 1's prompt = step 0's prompt + response + observation [90, 91].
APPEND_ONLY = [EpisodeStep([1, 2], [10, 11], 0.1), EpisodeStep([1, 2, 10, 11, 90, 91], [12], 1.0)]
# A context window dropped step 0's response, so step 1's prompt does not extend it.
WINDOWED = [EpisodeStep([1, 2], [20], 0.0), EpisodeStep([1, 2, 99], [21, 22], 0.5)]


def test_append_only_episode_keeps_observations_in_its_row():
    layout = build_episode_layout([APPEND_ONLY, WINDOWED])
    assert layout.append_only == (True, False)
    assert layout.input_ids.tolist() == [[1, 2, 10, 11, 90, 91, 12], [1, 2, 20, 21, 22, 0, 0]]
    assert layout.action_mask.tolist() == [[0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 0, 0]]
    assert layout.real_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]]
    assert layout.step_starts.tolist() == [[False, False, True, False, False, False, True],
                                           [False, False, True, True, False, False, False]]
    assert torch.allclose(layout.token_rewards, torch.tensor([[0, 0, 0, 0.1, 0, 0, 1.0], [0, 0, 0, 0, 0.5, 0, 0]]))
    assert layout.step_spans[0] == (StepSpan(2, 4, 6), StepSpan(6, 7, 7))
    assert layout.step_spans[1] == (StepSpan(2, 3, 3), StepSpan(3, 5, 5))
    # the critic's sequence is the row itself: column t = position t
    assert layout.row_context(0) == [1, 2, 10, 11, 90, 91, 12]
    assert layout.row_context(1) == [1, 2, 20, 21, 22]
    assert advantage_mask(layout, True).tolist() == layout.action_mask.float().tolist()
    assert advantage_mask(layout, False).tolist() == layout.real_mask.float().tolist()


def test_unpack_gives_back_each_steps_response_and_observation():
    layout = build_episode_layout([APPEND_ONLY, WINDOWED])
    ids = unpack(layout.input_ids, layout)
    assert ids[0] == [([10, 11], [90, 91]), ([12], [])]
    assert ids[1] == [([20], []), ([21, 22], [])]
    rewards = unpack(layout.token_rewards, layout)
    assert [parts.response[-1] for parts in rewards[0]] == pytest.approx([0.1, 1.0])
    with pytest.raises(ValueError, match="E = 2"):
        unpack(torch.zeros(3, 7), layout)


def test_empty_response_hands_its_reward_to_the_last_action_before_it():
    episode = [EpisodeStep([1], [10], 0.25), EpisodeStep([1, 2], [], 1.0)]
    layout = build_episode_layout([episode])
    assert layout.token_rewards.tolist() == [[0.0, 1.25]]
    assert layout.step_starts.tolist() == [[False, True]]
    with pytest.raises(ValueError, match="episode 0 step 0"):
        build_episode_layout([[EpisodeStep([1], [], 1.0), EpisodeStep([1], [3], 0.0)]])


def test_combine_rewards_by_hand():
    process = [[0.2, -0.1, 0.0], [0.5]]
    outcome = [[0.0, 0.0, 1.0], [0.0]]
    plain = combine_rewards(process, outcome, process_weight=0.5, normalize="none")
    assert plain[0] == pytest.approx([0.1, -0.05, 1.0]) and plain[1] == pytest.approx([0.25])
    # episode process sums 0.1 and 0.5: max_abs divides every process reward by 0.5
    scaled = combine_rewards(process, outcome, process_weight=0.5, normalize="max_abs")
    assert scaled[0] == pytest.approx([0.2, -0.1, 1.0]) and scaled[1] == pytest.approx([0.5])
    assert combine_rewards([[0.0]], [[1.0]], process_weight=1.0, normalize="max_abs") == [[1.0]]


def test_combine_rewards_rejects_bad_input():
    with pytest.raises(ValueError, match=r"episode 0: outcome reward on step\(s\) \[0\]"):
        combine_rewards([[0.0, 0.0]], [[1.0, 0.0]], process_weight=1.0, normalize="none")
    with pytest.raises(ValueError, match="valid: none, max_abs"):
        combine_rewards([[0.0]], [[1.0]], process_weight=1.0, normalize="mean")
    with pytest.raises(ValueError, match="episode 0: 2 process rewards but 1"):
        combine_rewards([[0.0, 0.0]], [[1.0]], process_weight=1.0, normalize="none")


def rows():
    """Episode a (append-only, two steps) and b (windowed), one group, given out of order. Rewards as
    labelling combines them with process weight 0.5: a's step 0 process reward 0.2 -> 0.1, its
    outcome 1.0; b's step 1 process reward -0.2 -> -0.1."""
    return [
        StepRewardRow("a", "g", 1, [1, 2, 10, 11, 90, 91], [12], 1.0),
        StepRewardRow("b", "g", 0, [1, 2], [20], 0.0),
        StepRewardRow("a", "g", 0, [1, 2], [10, 11], 0.1),
        StepRewardRow("b", "g", 1, [1, 2, 99], [21, 22], -0.1),
    ]


SETTINGS = dict(gamma=1.0, lam=1.0, eps=1e-6, norm_by_std=False)


def advantages_for_steps(step_rows, **settings):
    """Both stage calls in one (values / kl_penalty as functions of the layout)."""
    return estimate_step_advantages(prepare_episodes(step_rows), **settings)


def test_grpo_results_align_with_each_steps_response():
    results = advantages_for_steps(rows(), estimator="grpo", use_advantage_mask=True, **SETTINGS)
    by_step = {(r.episode_id, r.step_idx): r for r in results}
    # scores: a = 0.5*0.2 + 1 = 1.1, b = 0.5*(-0.2) = -0.1; group mean 0.5
    assert by_step["a", 0].advantages == pytest.approx([0.6, 0.6])
    assert by_step["a", 1].advantages == pytest.approx([0.6])
    assert by_step["b", 1].advantages == pytest.approx([-0.6, -0.6])
    assert by_step["a", 0].returns == pytest.approx([1.1, 1.1])
    assert all(r.values is None and r.obs_advantages is None for r in results)


def test_gae_with_a_critic_function_and_the_mask_off_fills_observations():
    seen = []

    def zero_critic(layout):
        seen.append(layout.token_rewards.shape)
        return torch.zeros(layout.token_rewards.shape)

    common = dict(estimator="gae", values=zero_critic, **SETTINGS)
    on = {(r.episode_id, r.step_idx): r for r in advantages_for_steps(rows(), use_advantage_mask=True, **common)}
    # zero values, gamma = lam = 1: advantages are rewards-to-go; a: 0.1 on column 3, 1 on column 6
    assert on["a", 0].advantages == pytest.approx([1.1, 1.1])
    assert on["a", 0].values == [0.0, 0.0] and on["a", 0].obs_advantages is None
    off = {(r.episode_id, r.step_idx): r for r in advantages_for_steps(rows(), use_advantage_mask=False, **common)}
    assert off["a", 0].obs_advantages == pytest.approx([1.0, 1.0])
    assert off["a", 0].obs_returns == pytest.approx([1.0, 1.0]) and off["a", 0].obs_values == [0.0, 0.0]
    assert off["a", 1].obs_advantages is None  # the last step has no observation in the grid
    assert off["b", 0].obs_advantages is None  # a windowed episode has none at all
    assert seen == [(2, 7), (2, 7)]


def test_kl_penalty_is_taken_from_action_tokens_only():
    batch = prepare_episodes(rows())
    penalty = torch.full(batch.layout.token_rewards.shape, 0.1)  # 0.1 on every column, observations too
    results = estimate_step_advantages(
        batch, estimator="grpo", gamma=1.0, lam=1.0, eps=1e-6, norm_by_std=False,
        use_advantage_mask=True, kl_penalty=penalty,
    )
    by_step = {(r.episode_id, r.step_idx): r for r in results}
    # a has 3 action tokens: 1.1 - 0.3; b has 3: -0.1 - 0.3 (a's 2 tool tokens are not penalised)
    assert by_step["a", 0].returns == pytest.approx([0.8, 0.8])
    assert by_step["b", 0].returns == pytest.approx([-0.4])
    with pytest.raises(ValueError, match="kl_penalty shape"):
        estimate_step_advantages(
            batch, estimator="grpo", gamma=1.0, lam=1.0, eps=1e-6, norm_by_std=False,
            use_advantage_mask=True, kl_penalty=torch.zeros(2, 2),
        )


def test_entry_point_errors_name_the_episode_or_the_missing_critic():
    with pytest.raises(ValueError, match="needs a critic"):
        advantages_for_steps(rows(), estimator="gae", use_advantage_mask=True, **SETTINGS)
    gap = [r for r in rows() if not (r.episode_id == "a" and r.step_idx == 0)]
    with pytest.raises(ValueError, match="episode 'a': step_idx must run 0..0; got \\[1\\]"):
        advantages_for_steps(gap, estimator="grpo", use_advantage_mask=True, **SETTINGS)
    mixed = rows()[:3] + [StepRewardRow("b", "h", 1, [1], [3], 0.0)]
    with pytest.raises(ValueError, match="episode 'b': steps disagree on group_id"):
        advantages_for_steps(mixed, estimator="grpo", use_advantage_mask=True, **SETTINGS)


def test_loss_mask_off_gives_observations_the_advantage_of_the_action_they_follow():
    common = dict(estimator="gae", values=lambda layout: torch.full(layout.token_rewards.shape, 0.25), **SETTINGS)
    off = {(r.episode_id, r.step_idx): r
           for r in advantages_for_steps(rows(), use_advantage_mask=True, use_loss_mask=False, **common)}
    on = {(r.episode_id, r.step_idx): r for r in advantages_for_steps(rows(), use_advantage_mask=True, **common)}
    for key in on:  # the loss mask is no input of the estimator
        assert off[key].advantages == on[key].advantages and off[key].returns == on[key].returns
    # a's step 0 response [10, 11], observation [90, 91]: the observation takes column 1's advantage
    # (values 0.25, gamma = lam = 1: A_3 = 0.1 + 0.25 - 0.25 + A_6 = 0.1 + 0.75)
    assert off["a", 0].advantages[-1] == pytest.approx(0.85)
    assert off["a", 0].obs_advantages == pytest.approx([0.85, 0.85])
    # no value targets there: the critic keeps to the advantage mask
    assert off["a", 0].obs_returns is None and off["a", 0].obs_values is None
    assert off["a", 1].obs_advantages is None and off["b", 0].obs_advantages is None


def test_grpo_observations_carry_the_episode_advantage_with_the_loss_mask_off():
    results = advantages_for_steps(rows(), estimator="grpo", use_advantage_mask=True, use_loss_mask=False, **SETTINGS)
    by_step = {(r.episode_id, r.step_idx): r for r in results}
    assert by_step["a", 0].obs_advantages == pytest.approx([0.6, 0.6])  # episode a's advantage (see above)


def test_carry_into_observations_by_hand():
    values = torch.tensor([[0.0, 2.0, 9.0, 9.0, 5.0, 9.0], [9.0, 3.0, 9.0, 0.0, 0.0, 0.0]])
    action = torch.tensor([[0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 0, 0]])
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    # before the first action: 0; observations: the last action's value; padding: 0
    assert carry_into_observations(values, action, real).tolist() == [[0, 2, 2, 2, 5, 5], [0, 3, 3, 0, 0, 0]]


def test_whitening_is_passed_to_the_estimator():
    common = dict(estimator="gae", values=lambda layout: torch.zeros(layout.token_rewards.shape), **SETTINGS)
    plain = [a for r in advantages_for_steps(rows(), use_advantage_mask=True, **common) for a in r.advantages]
    white = [a for r in advantages_for_steps(rows(), use_advantage_mask=True, whiten=True, **common)
             for a in r.advantages]
    mean = sum(plain) / len(plain)
    std = (sum((a - mean) ** 2 for a in plain) / (len(plain) - 1)) ** 0.5
    assert white == pytest.approx([(a - mean) / (std + 1e-6) for a in plain], abs=1e-6)
