"""Packed episodes vs step rows: layout choice, equal log-probs/loss/gradients, mask invariance."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from agent_core.algos.losses import ppo_clip_loss
from agent_core.algos.masks import derive_masks
from agent_core.training.batches import (
    TrainStep, choose_layout, episode_sequence, episode_step_sequences, is_append_only, make_micro_batches,
)
from agent_core.training.critic import score_values, value_model_from_policy
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.settings import PPOSettings
from agent_core.training.scoring import score_logprobs, sequence_logprobs
from agent_core.training.trainer import train_iteration

PAD = 0


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer(["who wrote hamlet? <search>hamlet</search> <answer>shakespeare</answer>"] * 3,
                                vocab_size=300)
    return build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, seed=2)


def append_only_episode(seed: int, spans=((5, 3, 4), (0, 2, 3), (0, 4, 0)), with_obs=True, critic=True):
    """Steps whose prompts extend the previous prompt + response: (prompt, response, observation) sizes."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randint(3, 250) for _ in range(n)]  # noqa: E731
    floats = lambda n, lo, hi: [rng.uniform(lo, hi) for _ in range(n)]  # noqa: E731
    steps, context = [], []
    for prompt_extra, response_len, obs_len in spans:
        context = context + tokens(prompt_extra)
        response = tokens(response_len)
        steps.append(TrainStep(
            prompt_ids=list(context), response_ids=response, response_logprobs=floats(response_len, -6.0, -4.0),
            advantages=floats(response_len, -1.0, 1.0), ref_logprobs=floats(response_len, -6.0, -4.0),
            values=floats(response_len, -1, 1) if critic else None,
            returns=floats(response_len, -1, 1) if critic else None,
            obs_advantages=floats(obs_len, -1, 1) if with_obs and obs_len else None,
            obs_returns=floats(obs_len, -1, 1) if with_obs and obs_len else None,
            obs_values=floats(obs_len, -1, 1) if with_obs and obs_len else None,
        ))
        context = context + response + tokens(obs_len)
    return steps


def test_episode_sequence_places_every_span():
    steps = [
        TrainStep([1, 2], [3, 4], [-0.1, -0.2], [1.0, 2.0], values=[0.1, 0.2], returns=[1.1, 1.2],
                  obs_advantages=[9.0], obs_returns=[8.0], obs_values=[7.0]),
        TrainStep([1, 2, 3, 4, 5], [6], [-0.3], [3.0], values=[0.3], returns=[1.3]),
    ]
    packed = episode_sequence(steps)
    assert packed.input_ids == [1, 2, 3, 4, 5, 6]
    assert packed.action_mask == [0, 0, 1, 1, 0, 1]
    assert packed.old_logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert packed.advantages == [0.0, 0.0, 1.0, 2.0, 9.0, 3.0]
    assert packed.old_values == [0.0, 0.0, 0.1, 0.2, 7.0, 0.3]
    assert packed.returns == [0.0, 0.0, 1.1, 1.2, 8.0, 1.3]
    assert packed.ref_logprobs is None
    rows = episode_step_sequences(steps)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]
    # step 0's observation values sit on step 1's prompt suffix (token 5)
    assert rows[1].advantages == [0.0, 0.0, 0.0, 0.0, 9.0, 3.0]
    assert rows[1].old_values == [0.0, 0.0, 0.0, 0.0, 7.0, 0.3]
    bad = [TrainStep([1, 2], [3, 4], [-0.1, -0.2], [1.0, 2.0], obs_advantages=[1.0, 2.0]),
           TrainStep([1, 2, 3, 4, 5], [6], [-0.3], [3.0])]
    with pytest.raises(ValueError, match="obs_advantages has 2 entries but the observation has 1 tokens"):
        episode_sequence(bad)


def test_layout_choice_by_name():
    packable = append_only_episode(0)
    windowed = append_only_episode(1)
    windowed[2] = TrainStep(windowed[2].prompt_ids[3:], windowed[2].response_ids, windowed[2].response_logprobs,
                            windowed[2].advantages)  # context management dropped the first tokens
    windowed = [TrainStep(s.prompt_ids, s.response_ids, s.response_logprobs, s.advantages) for s in windowed]
    assert is_append_only(packable) and not is_append_only(windowed)
    auto = choose_layout([packable, windowed])
    assert len(auto) == 1 + 3 and sum(auto[0].action_mask) == 3 + 2 + 4
    assert len(choose_layout([packable, windowed], "step")) == 6
    with pytest.raises(ValueError, match="episode 1 is not"):
        choose_layout([packable, windowed], "packed")
    with pytest.raises(ValueError, match="auto, step, packed"):
        choose_layout([packable], "pack")


def test_packed_and_step_rows_give_equal_logprobs_values_and_loss(policy):
    episodes = [append_only_episode(3), append_only_episode(4, spans=((3, 2, 2), (0, 5, 0)))]
    packed = choose_layout(episodes, "packed")
    rows = choose_layout(episodes, "step")
    packed_lp = score_logprobs(policy, [s.input_ids for s in packed], PAD, 4096, 1.0)
    rows_lp = score_logprobs(policy, [s.input_ids for s in rows], PAD, 4096, 1.0)
    critic = value_model_from_policy(policy)
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(0))
    packed_v = score_values(critic, [s.input_ids for s in packed], PAD, 4096)
    rows_v = score_values(critic, [s.input_ids for s in rows], PAD, 4096)
    row = 0
    for episode, lp, v in zip(episodes, packed_lp, packed_v):
        for _ in episode:  # each step row is a prefix of its packed episode
            n = len(rows[row])
            assert rows_lp[row] == pytest.approx(lp[:n], abs=1e-5)
            assert rows_v[row] == pytest.approx(v[:n], abs=1e-5)
            row += 1

    def one_step(sequences):
        model = copy.deepcopy(policy)
        before = [p.detach().clone() for p in model.parameters()]
        settings = PPOSettings(max_grad_norm=None, agg_mode="token-mean", kl_coef=0.1)
        [result] = train_iteration(model, torch.optim.SGD(model.parameters(), lr=1.0), sequences, settings, pad_id=PAD)
        return result, [p.detach() - b for p, b in zip(model.parameters(), before)]

    packed_result, packed_delta = one_step(packed)
    rows_result, rows_delta = one_step(rows)
    assert packed_result.tokens == rows_result.tokens == 3 + 2 + 4 + 2 + 5
    assert packed_result.loss == pytest.approx(rows_result.loss, abs=1e-5)
    assert packed_result.kl == pytest.approx(rows_result.kl, abs=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(packed_delta, rows_delta))


def with_new_observation_values(steps, seed):
    rng = random.Random(seed)
    redo = lambda v: None if v is None else [rng.uniform(-3, 3) for _ in v]  # noqa: E731
    return [TrainStep(s.prompt_ids, s.response_ids, s.response_logprobs, s.advantages, s.ref_logprobs, s.values,
                      s.returns, redo(s.obs_advantages), redo(s.obs_returns), redo(s.obs_values)) for s in steps]


def update_deltas(policy, sequences, use_masks: bool):
    model, critic = copy.deepcopy(policy), value_model_from_policy(policy)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters()) + list(critic.parameters())
    before = [p.detach().clone() for p in params]
    [result] = train_iteration(
        model, torch.optim.SGD(model.parameters(), lr=1.0), sequences,
        PPOSettings(max_grad_norm=None, value_clip=None, use_loss_mask=use_masks, use_advantage_mask=use_masks),
        pad_id=PAD, critic=critic, critic_optimizer=torch.optim.SGD(critic.parameters(), lr=1.0),
    )
    assert not result.skipped
    n_policy = len(list(model.parameters()))
    deltas = [p.detach() - b for p, b in zip(params, before)]
    return deltas[:n_policy], deltas[n_policy:]


def same(a, b) -> bool:
    return all(torch.allclose(x, y, atol=1e-7, rtol=1e-5) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", ["packed", "step"])
def test_observation_values_reach_no_gradient_with_masks_on_and_do_with_masks_off(policy, layout):
    episode = append_only_episode(5)
    changed = with_new_observation_values(episode, seed=6)
    base, moved = choose_layout([episode], layout), choose_layout([changed], layout)
    assert base[-1].advantages != moved[-1].advantages  # the observation values are in the rows
    policy_on, critic_on = update_deltas(policy, base, use_masks=True)
    policy_on2, critic_on2 = update_deltas(policy, moved, use_masks=True)
    assert same(policy_on, policy_on2) and same(critic_on, critic_on2)
    policy_off, critic_off = update_deltas(policy, base, use_masks=False)
    policy_off2, critic_off2 = update_deltas(policy, moved, use_masks=False)
    assert not same(policy_off, policy_off2) and not same(critic_off, critic_off2)


def test_observation_tokens_have_no_loss_term_of_their_own_with_the_loss_mask_on(policy):
    packed = episode_sequence(append_only_episode(7))
    batch = make_micro_batches([packed], max_tokens=4096, pad_id=PAD)[0]
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(policy, batch.input_ids, batch.attention_mask)
    observation = (batch.action_mask == 0) & (torch.arange(len(packed)) >= packed.action_mask.index(1))
    assert observation.sum() == 4 + 3  # the two observation spans between responses
    for use_loss_mask, trained in ((True, False), (False, True)):
        masks = derive_masks(batch.action_mask, batch.attention_mask, use_loss_mask=use_loss_mask,
                             use_advantage_mask=use_loss_mask)
        leaf = logprobs.clone().requires_grad_(True)
        old = torch.where(batch.action_mask.bool(), batch.old_logprobs, logprobs)
        ppo_clip_loss(leaf, old, batch.advantages * masks.advantage_mask, masks.loss_mask).loss.backward()
        assert bool(torch.all(leaf.grad[observation] != 0)) == trained
        assert bool(torch.any(leaf.grad[observation] != 0)) == trained
