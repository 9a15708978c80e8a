"""GSPO (sequence-level ratio and clip per action), three ways: by hand, against a loop written
from the paper's equations, and by invariances; plus the action segments in both layouts and a
real optimizer step through the trainer."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from agent_core.algos.gspo import action_segments, gspo_loss, sequence_log_ratios
from agent_core.algos.losses import POLICY_LOSSES, aggregate_loss, ppo_clip_loss
from agent_core.algos.masks import derive_masks
from agent_core.training.batches import TrainStep, episode_sequence, episode_step_sequences, pad_sequences
from agent_core.training.trainer import make_optimizer, ppo_update
from tests.test_trainer import PAD, UPDATE, random_steps, tiny_llama

LOSS = POLICY_LOSSES.get("gspo")
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# Two rows. Row 0: prompt, prompt, action (2 tokens), observation, action (3 tokens); row 1:
# prompt, action (2 tokens), padding. Each action's token log-ratios spread around log(s) so that
# their mean is exactly log(s): s = 1.1, 0.5, 1.5, while the token ratios themselves differ.
MASK = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
L11, L05, L15 = math.log(1.1), math.log(0.5), math.log(1.5)
LOG_RATIO = torch.tensor([
    [0.0, 0.0, L11 + 0.5, L11 - 0.5, 0.0, L05 + 0.2, L05, L05 - 0.2],
    [0.0, L15 + 0.1, L15 - 0.1, 0.0, 0.0, 0.0, 0.0, 0.0],
])
ADV = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, -1.0, -1.0, -1.0], [0.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
OLD = -torch.linspace(0.5, 3.0, 16).view(2, 8)


def hand_batch():
    return (OLD + LOG_RATIO).requires_grad_(True), OLD, ADV, MASK


def test_sequence_ratios_and_loss_by_hand():
    logprobs, old, adv, mask = hand_batch()
    segments = action_segments(mask)
    assert segments.count == 3 and segments.rows.tolist() == [0, 0, 1] and segments.lengths.tolist() == [2, 3, 2]
    ratios = sequence_log_ratios(logprobs, old, segments).exp()
    assert torch.allclose(ratios, torch.tensor([1.1, 0.5, 1.5]), atol=1e-5)
    # clip range [0.8, 1.2]: action 0 (A=+1, s=1.1) unclipped, -1.1; action 1 (A=-1, s=0.5)
    # clipped at 0.8, +0.8; action 2 (A=+2, s=1.5) clipped at 1.2, -2.4.
    out = LOSS(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2, agg_mode="token-mean")
    assert out.loss.item() == pytest.approx((2 * -1.1 + 3 * 0.8 + 2 * -2.4) / 7, abs=1e-5)  # -0.657
    assert out.clipfrac.item() == pytest.approx(5 / 7)  # 5 of 7 tokens sit in a clipped action
    out.loss.backward()
    # only action 0 is unclipped: each of its tokens gets -A * s / |y| * |y| / N = -1.1 / 7
    expected = torch.zeros_like(MASK)
    expected[0, 2:4] = -1.1 / 7
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    seq_mean = LOSS(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2, agg_mode="seq-mean-token-mean")
    assert seq_mean.loss.item() == pytest.approx(((-2.2 + 2.4) / 5 + -2.4) / 2, abs=1e-5)  # -1.18
    # PPO's token ratios (1.81 and 0.67 in action 0) clip differently: -0.6096, not -0.657
    ppo = ppo_clip_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2, agg_mode="token-mean")
    assert ppo.loss.item() == pytest.approx(-4.2672 / 7, abs=1e-4)


def reference_gspo(logprobs, old, adv, mask, clip_low, clip_high, mode, norm_length=None):
    """GSPO from the paper's equations, one row and one action at a time (no vectorisation)."""
    rows, width = mask.shape
    row_terms, total_tokens = [], 0
    for b in range(rows):
        runs, t = [], 0
        while t < width:
            if mask[b, t] > 0:
                start = t
                while t < width and mask[b, t] > 0:
                    t += 1
                runs.append(range(start, t))
            else:
                t += 1
        row_sum, row_tokens = torch.zeros(()), 0
        for run in runs:
            s = torch.exp(sum(logprobs[b, t] - old[b, t] for t in run) / len(run))
            a = sum(float(adv[b, t]) for t in run) / len(run)
            per_token = torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high))
            row_sum, row_tokens = row_sum + len(run) * per_token, row_tokens + len(run)
        total_tokens += row_tokens
        if row_tokens:
            row_terms.append((row_sum, row_tokens))
    if mode == "token-mean":
        return sum(r for r, _ in row_terms) / total_tokens
    if mode == "seq-mean-token-mean":
        return sum(r / n for r, n in row_terms) / len(row_terms)
    return sum(r / (norm_length or width) for r, _ in row_terms) / len(row_terms)


def random_batch(seed, rows=6, width=14):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=gen) < 0.6).float()
    mask[:, 0] = 0.0
    mask[2] = 0.0  # a row with no action
    old = -torch.rand(rows, width, generator=gen) * 3
    drift = torch.randn(rows, 1, generator=gen) * 0.15 + torch.randn(rows, width, generator=gen) * 0.3
    logprobs = (old + drift).requires_grad_(True)
    return logprobs, old, torch.randn(rows, width, generator=gen), mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_matches_the_reference_loop_values_and_gradients(mode, seed):
    logprobs, old, adv, mask = random_batch(seed)
    kwargs = dict(clip_low=0.1, clip_high=0.15)
    fast = LOSS(logprobs, old, adv, mask, agg_mode=mode, **kwargs)
    (fast_grad,) = torch.autograd.grad(fast.loss, logprobs)
    slow = reference_gspo(logprobs, old, adv, mask, mode=mode, **kwargs)
    (slow_grad,) = torch.autograd.grad(slow, logprobs)
    assert fast.loss.item() == pytest.approx(slow.item(), abs=1e-5)
    assert torch.allclose(fast_grad, slow_grad, atol=1e-6)


def test_random_batches_mix_clipped_and_unclipped_actions():
    fractions = []
    for seed in range(4):
        logprobs, old, adv, mask = random_batch(seed)
        fractions.append(LOSS(logprobs, old, adv, mask, clip_low=0.1, clip_high=0.15).clipfrac.item())
    assert any(0 < f < 1 for f in fractions)  # the comparison above covers both branches


def tiny_policy_logprobs(seed, rows=4, width=10, vocab=7):
    """Log-probs of sampled tokens under a small linear softmax policy with parameters W."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(5, vocab, generator=gen).requires_grad_(True)
    features = torch.randn(rows, width, 5, generator=gen)
    tokens = torch.randint(0, vocab, (rows, width), generator=gen)
    logprobs = torch.log_softmax(features @ weights, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    return weights, logprobs


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ratio_one_gives_the_unclipped_sequence_level_policy_gradient(mode):
    weights, logprobs = tiny_policy_logprobs(0)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0, 0]] * 2 + [[0, 0, 1, 1, 1, 1, 1, 0, 1, 0]] * 2).float()
    adv = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    # even the paper's tiny clip range cannot bind at s = 1
    loss = LOSS(logprobs, logprobs.detach(), adv, mask, clip_low=3e-4, clip_high=4e-4, agg_mode=mode).loss
    (gspo_grad,) = torch.autograd.grad(loss, weights, retain_graph=True)
    # sequence-level policy gradient: -A_i * mean over action i of log pi, each action weighed by the mode
    segments = action_segments(mask)
    if mode == "token-mean":
        weight = segments.lengths / mask.sum()
    else:
        weight = segments.lengths / mask.sum(-1)[segments.rows] / 4
    advantage = segments.mean(adv)
    objective = (weight * -advantage * segments.mean(logprobs)).sum()
    (expected,) = torch.autograd.grad(objective, weights)
    assert loss.item() == pytest.approx((weight * -advantage).sum().item(), abs=1e-6)  # -A_i at s = 1, aggregated
    assert torch.allclose(gspo_grad, expected, atol=1e-6)


def test_the_sequence_is_clipped_not_the_token():
    mask = torch.tensor([[0.0] + [1.0] * 10])
    old = torch.full((1, 11), -2.0)
    adv = torch.ones(1, 11)
    # one token's ratio e^0.9 = 2.46 is far outside [0.8, 1.2], but the geometric mean is exactly 1
    logprobs = (old + torch.tensor([[0.0, 0.9] + [-0.1] * 9])).requires_grad_(True)
    out = LOSS(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2, agg_mode="token-mean")
    out.loss.backward()
    assert out.clipfrac.item() == 0.0 and out.loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert logprobs.grad[0, 1].item() == pytest.approx(-0.1, abs=1e-6)  # -A * s / N: the big token still learns
    ppo = ppo_clip_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert ppo.clipfrac.item() == pytest.approx(0.1)  # PPO clips that token
    # the paper's clip range: token ratios e^(+-0.01) all lie outside [1 - 3e-4, 1 + 4e-4], their mean does not
    wobble = old + torch.tensor([[0.0] + [0.01, -0.01] * 5])
    assert LOSS(wobble, old, adv, mask, clip_low=3e-4, clip_high=4e-4).clipfrac.item() == 0.0
    assert ppo_clip_loss(wobble, old, adv, mask, clip_low=3e-4, clip_high=4e-4).clipfrac.item() == pytest.approx(0.5)
    # and a whole action drifting by 1e-3 per token is clipped as one
    drifted = (old + 1e-3).requires_grad_(True)
    clipped = LOSS(drifted, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    clipped.loss.backward()
    assert clipped.clipfrac.item() == 1.0 and torch.count_nonzero(drifted.grad) == 0


def test_tokens_outside_the_loss_mask_get_zero_gradient_whatever_they_hold():
    logprobs, old, adv, mask = random_batch(7)
    clean = LOSS(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    off = mask == 0
    garbage = torch.where(off, torch.tensor(float("nan")), logprobs.detach()).requires_grad_(True)
    noisy_adv = torch.where(off, torch.tensor(1e6), adv)
    out = LOSS(garbage, torch.where(off, 50.0, old), noisy_adv, mask, clip_low=0.2, clip_high=0.2)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(clean.loss.item(), abs=1e-6)
    assert torch.isfinite(garbage.grad).all() and (garbage.grad[off] == 0).all()
    assert math.isfinite(out.approx_kl.item())


def test_one_advantage_per_action_the_mean_of_its_tokens():
    logprobs, old, adv, mask = random_batch(3)
    segments = action_segments(mask)
    constant = segments.broadcast(segments.mean(adv))
    for mode in MODES:
        varying = LOSS(logprobs, old, adv, mask, agg_mode=mode)
        flat = LOSS(logprobs, old, constant, mask, agg_mode=mode)
        assert varying.loss.item() == pytest.approx(flat.loss.item(), abs=1e-6)
        (g1,) = torch.autograd.grad(varying.loss, logprobs)
        (g2,) = torch.autograd.grad(flat.loss, logprobs)
        assert torch.allclose(g1, g2, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_normalizers_equal_one_batch(mode):
    logprobs, old, adv, mask = random_batch(5)
    kwargs = dict(agg_mode=mode, clip_low=0.1, clip_high=0.15, norm_length=20.0)
    whole = LOSS(logprobs, old, adv, mask, **kwargs).loss
    norms = dict(num_tokens=float(mask.sum()), num_sequences=float((mask.sum(1) > 0).sum()))
    total = sum(LOSS(logprobs[idx], old[idx], adv[idx], mask[idx], **kwargs, **norms).loss
                for idx in (torch.tensor([0, 3]), torch.tensor([1, 2, 5]), torch.tensor([4])))
    assert total.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(torch.autograd.grad(total, logprobs)[0], torch.autograd.grad(whole, logprobs)[0], atol=1e-7)


def test_no_action_in_a_micro_batch_is_a_zero_loss_that_backpropagates():
    logprobs = torch.randn(2, 5).requires_grad_(True)
    out = LOSS(logprobs, logprobs.detach(), torch.ones(2, 5), torch.zeros(2, 5))
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.clipfrac.item() == 0.0 and (logprobs.grad == 0).all()
    with pytest.raises(ValueError, match="one \\[B, L\\] shape"):
        LOSS(logprobs, logprobs, torch.ones(2, 4), torch.zeros(2, 5))


def episode_steps():
    """Three append-only steps: each prompt = the previous prompt + response + observation glue."""
    prompt0, glue = [1, 2, 3], [[40, 41], [42]]
    responses = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    prompts = [prompt0]
    for k in range(2):
        prompts.append(prompts[-1] + responses[k] + glue[k])
    return [TrainStep(prompt_ids=p, response_ids=r, response_logprobs=[-0.1 * (i + 1) - k for i in range(len(r))],
                      advantages=[float(k)] * len(r), step_idx=k)
            for k, (p, r) in enumerate(zip(prompts, responses))]


def test_one_action_is_one_segment_in_both_layouts():
    steps = episode_steps()
    per_layout = []
    for rows in ([episode_sequence(steps)], episode_step_sequences(steps)):
        batch = pad_sequences(rows, tuple(range(len(rows))), pad_id=0)
        masks = derive_masks(batch.action_mask, batch.attention_mask, use_loss_mask=True, use_advantage_mask=True,
                             response_start=batch.response_start)
        segments = action_segments(masks.loss_mask)
        per_layout.append((segments.lengths.tolist(), segments.mean(batch.old_logprobs),
                           segments.mean(batch.advantages)))
    (packed_len, packed_lp, packed_adv), (step_len, step_lp, step_adv) = per_layout
    assert packed_len == step_len == [3.0, 2.0, 4.0]
    assert torch.allclose(packed_lp, step_lp) and packed_adv.tolist() == step_adv.tolist() == [0.0, 1.0, 2.0]


def test_registered_and_trains_through_the_trainer():
    assert LOSS is gspo_loss and "gspo" in POLICY_LOSSES.names()
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    settings = replace(UPDATE, policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, agg_mode="seq-mean-token-mean")
    result = ppo_update(model, make_optimizer(model, lr=1e-2), random_steps(0), settings, pad_id=PAD)
    assert not result.skipped and math.isfinite(result.loss)
    assert 0.0 <= result.clipfrac <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_aggregate_of_broadcast_equals_the_per_action_sum_by_hand():
    # token-mean weighs each action by its length: (2 * a + 3 * b) / 5 for a 2- and a 3-token action
    segments = action_segments(torch.tensor([[0, 1, 1, 0, 1, 1, 1]]).float())
    loss = aggregate_loss(segments.broadcast(torch.tensor([1.0, 2.0])), segments.on.float(), "token-mean")
    assert loss.item() == pytest.approx((2 * 1.0 + 3 * 2.0) / 5)
