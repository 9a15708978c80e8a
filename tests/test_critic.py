"""The value model: alignment of values with log-probs, checkpoints, learning, batched scoring."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from agent_core.algos.losses import clipped_value_loss
from agent_core.algos.step_advantages import StepRewardRow, prepare_episodes, score_on_grid
from agent_core.io.checkpoints import save_critic, save_policy
from agent_core.training.batches import TrainSequence, TrainStep, choose_layout, make_micro_batches
from agent_core.training.critic import (
    ValueModel,
    build_critic,
    load_critic,
    score_logprobs,
    score_values,
    value_model_from_policy,
)
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.prepared import prepare_update
from agent_core.training.settings import PPOSettings
from agent_core.training.scoring import sequence_logprobs
from agent_core.training.trainer import train_iteration

TEXTS = ["the capital of france is paris", "<search>who wrote hamlet</search>", "<answer>shakespeare</answer>"] * 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def policy(tokenizer):
    return build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, seed=1).eval()


def random_head(critic: ValueModel, seed: int = 0) -> ValueModel:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape, generator=gen))
        critic.value_head.bias.fill_(0.3)
    return critic


SEQUENCES = [[5, 9, 44, 17, 3], [8, 2], [60, 61, 62, 63, 64, 65, 66, 67], [12, 13, 14]]


def padded(sequences):
    rows = [TrainSequence(s, [0] * len(s), [0.0] * len(s), [0.0] * len(s)) for s in sequences]
    return make_micro_batches(rows, max_tokens=10_000, pad_id=0)[0]


def test_a_fresh_critic_predicts_zero_and_values_use_the_state_before_each_token(policy):
    critic = value_model_from_policy(policy).eval()
    batch = padded(SEQUENCES)
    with torch.no_grad():
        assert torch.equal(critic.values(batch.input_ids, batch.attention_mask), torch.zeros(batch.input_ids.shape))
        random_head(critic)
        values = critic.values(batch.input_ids, batch.attention_mask)
        assert values.shape == batch.input_ids.shape and values.dtype == torch.float32
        for row, index in enumerate(batch.indices):
            tokens = SEQUENCES[index]
            assert values[row, 0] == 0 and torch.all(values[row, len(tokens):] == 0)
            for t in range(1, len(tokens)):
                # unpadded prefix tokens[:t], its own forward pass: V(state before token t)
                hidden = critic.backbone(input_ids=torch.tensor([tokens[:t]])).last_hidden_state[0, -1]
                expected = float(critic.value_head(hidden))
                assert values[row, t].item() == pytest.approx(expected, abs=1e-5)


def test_critic_copies_the_policy_backbone_and_leaves_the_policy_alone(policy, tmp_path):
    critic = value_model_from_policy(policy)
    with torch.no_grad():
        next(critic.backbone.parameters()).add_(1.0)
    policy_weights = dict(policy.base_model.named_parameters())
    changed = [n for n, p in critic.backbone.named_parameters() if not torch.equal(p, policy_weights[n])]
    assert len(changed) == 1  # the copy is independent: only the critic's tensor moved

    tokenizer = build_tokenizer(TEXTS, vocab_size=300)
    policy_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    built = build_critic(policy_dir)
    for name, parameter in built.backbone.named_parameters():
        assert torch.equal(parameter, policy_weights[name]), name
    assert torch.count_nonzero(built.value_head.weight) == 0 and float(built.value_head.bias.detach()) == 0.0


def test_save_and_load_round_trip_gives_identical_values(policy, tmp_path):
    critic = random_head(value_model_from_policy(policy), seed=4).eval()
    batch = padded(SEQUENCES)
    directory = tmp_path / "critic"
    save_critic(value_model_from_policy(policy), directory)  # an older critic, replaced below
    save_critic(critic, directory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["critic"]  # no staging leftovers
    loaded = load_critic(directory).eval()
    with torch.no_grad():
        assert torch.equal(loaded.values(batch.input_ids, batch.attention_mask),
                           critic.values(batch.input_ids, batch.attention_mask))
    (directory / "value_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="value_head.safetensors"):
        load_critic(directory)


def test_a_few_value_loss_steps_reduce_the_loss_on_a_fixed_batch(policy):
    critic = value_model_from_policy(policy).train()
    batch = padded(SEQUENCES)
    gen = torch.Generator().manual_seed(0)
    returns = torch.randn(batch.input_ids.shape, generator=gen) * batch.attention_mask
    mask = batch.attention_mask.float()
    mask[:, 0] = 0
    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        values = critic.values(batch.input_ids, batch.attention_mask)
        loss = clipped_value_loss(values, values.detach(), returns, mask, clip_range=None).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_batched_scoring_matches_one_sequence_at_a_time_and_restores_the_mode(policy):
    critic = random_head(value_model_from_policy(policy)).train()
    values = score_values(critic, SEQUENCES, pad_id=0, max_tokens=12)  # several micro-batches
    logprobs = score_logprobs(policy, SEQUENCES, pad_id=0, max_tokens=12, temperature=0.8)
    assert critic.training and not policy.training
    assert [len(v) for v in values] == [len(s) for s in SEQUENCES] == [len(lp) for lp in logprobs]
    with torch.no_grad():
        for tokens, row_values, row_logprobs in zip(SEQUENCES, values, logprobs):
            ids = torch.tensor([tokens])
            alone = critic.eval().values(ids, torch.ones_like(ids))[0]
            assert row_values == pytest.approx(alone.tolist(), abs=1e-5)
            expected, _ = sequence_logprobs(policy, ids, torch.ones_like(ids), temperature=0.8)
            assert row_logprobs == pytest.approx(expected[0].tolist(), abs=1e-5)
            assert row_logprobs[0] == 0.0 and row_values[0] == 0.0


# ------------------------------------------- value targets on response regions, critic contexts

def append_only_steps():
    """Three steps of one append-only episode: first prompt [5, 9], observations [60, 61] and [62]."""
    contexts = [[5, 9], [5, 9, 44, 17, 60, 61], [5, 9, 44, 17, 60, 61, 3, 62]]
    responses = [[44, 17], [3], [12, 13]]
    return [TrainStep(c, r, [-1.0] * len(r), [0.5] * len(r), values=[0.1] * len(r), returns=[1.0] * len(r),
                      obs_advantages=obs, obs_returns=obs, obs_values=obs)
            for c, r, obs in zip(contexts, responses, [[0.3, 0.3], [0.2], None])]


def critic_delta(policy, sequences):
    critic = random_head(value_model_from_policy(policy), seed=2)
    before = [p.detach().clone() for p in critic.parameters()]
    model = copy.deepcopy(policy)
    settings = PPOSettings(max_grad_norm=None, value_clip=None, use_loss_mask=True, use_advantage_mask=False)
    train_iteration(model, torch.optim.SGD(model.parameters(), lr=0.0), sequences, settings, pad_id=0, critic=critic,
                    critic_optimizer=torch.optim.SGD(critic.parameters(), lr=1.0))
    return [p.detach() - b for p, b in zip(critic.parameters(), before)]


def test_value_targets_exist_only_on_each_rows_response_region(policy):
    rows = choose_layout([append_only_steps()], "step")
    prep = prepare_update(rows, torch.device("cpu"), pad_id=0, micro_batch_tokens=4096, use_loss_mask=True,
                          use_advantage_mask=False, norm_length=None)
    [batch], [masks] = prep.batches, prep.masks
    by_row = {index: masks.advantage_mask[row, : len(rows[index])].tolist() for row, index in enumerate(batch.indices)}
    # step 0: its response; step 1: step 0's observation + its response; step 2: likewise. Never
    # the first prompt, never the earlier actions in a step row's prompt (they have no target there)
    assert by_row[0] == [0, 0, 1, 1]
    assert by_row[1] == [0, 0, 0, 0, 1, 1, 1]
    assert by_row[2] == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    # the stored zeros on context positions are not targets: changing them moves nothing
    base = critic_delta(policy, rows)
    moved = [replace(r, returns=[9.0] * r.region_start + r.returns[r.region_start:]) for r in rows]
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(base, critic_delta(policy, moved)))
    observation = lambda r: range(r.region_start, r.action_mask.index(1))  # noqa: E731  (prompt suffix)
    suffix = [replace(r, returns=[9.0 if i in observation(r) else x for i, x in enumerate(r.returns)]) for r in rows]
    assert not all(torch.allclose(a, b, atol=1e-7) for a, b in zip(base, critic_delta(policy, suffix)))


def test_critic_values_come_from_the_context_each_action_was_generated_in(policy):
    critic = random_head(value_model_from_policy(policy), seed=3)
    # a last_k window: step 1's prompt drops step 0's response, so the episode's row (its
    # responses back to back) is a context the policy never saw
    windowed = [StepRewardRow("w", "g", 0, [5, 9], [44, 17], 0.0),
                StepRewardRow("w", "g", 1, [5, 9, 60, 61], [3, 12], 1.0)]
    packed = [StepRewardRow("p", "g", 0, [5, 9], [44], 0.0),
              StepRewardRow("p", "g", 1, [5, 9, 44, 62], [13], 1.0)]
    batch = prepare_episodes(windowed + packed)
    seen = []

    def score(contexts):
        seen.extend(contexts)
        return score_values(critic, contexts, 0, 4096)

    grid = score_on_grid(batch, score)
    assert seen == [[5, 9, 44, 17], [5, 9, 60, 61, 3, 12], [5, 9, 44, 62, 13]]
    own = score_values(critic, [r.prompt_ids + r.response_ids for r in windowed + packed], 0, 4096)
    # grid column t = position t of the episode's row; the first prompt [5, 9] takes columns 0 and 1
    assert grid[0, 2:6].tolist() == pytest.approx(own[0][2:] + own[1][4:], abs=1e-6)
    # append-only: one pass over the row [5, 9 | 44 | 62 | 13]; each action's value equals its own context's
    assert grid[1, 2:5].tolist() == pytest.approx([own[2][2]] + own[3][3:], abs=1e-6)
