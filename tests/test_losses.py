"""PPO clipped loss, loss aggregation, micro-batch accumulation and mask invariance."""

from __future__ import annotations

import math

import pytest
import torch

from agent_core.algos.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    entropy_from_logits,
    masked_mean,
    ppo_clip_loss,
)
from agent_core.algos.masks import derive_masks
from agent_core.registry import UnknownNameError

# (advantage, ratio) -> hand-worked per-token loss with clip range [0.8, 1.2]
CASES = [
    (1.0, 1.1, -1.1, False),  # inside the range: unclipped
    (1.0, 1.5, -1.2, True),  # above, positive advantage: clipped at 1.2
    (1.0, 0.5, -0.5, False),  # below, positive advantage: the pessimistic (unclipped) term
    (-1.0, 0.5, 0.8, True),  # below, negative advantage: clipped at 0.8
    (-1.0, 1.5, 1.5, False),  # above, negative advantage: unclipped (no upper bound without dual clip)
    (-2.0, 5.0, 10.0, False),  # huge ratio, negative advantage: loss grows with the ratio
]


def case_tensors(cases):
    advantages = torch.tensor([[c[0] for c in cases]])
    ratios = torch.tensor([[c[1] for c in cases]])
    old = torch.linspace(-3.0, -0.5, len(cases))[None]
    return old + ratios.log(), old, advantages


def test_ppo_clip_loss_hand_worked_values():
    logprobs, old, advantages = case_tensors(CASES)
    logprobs.requires_grad_(True)
    out = ppo_clip_loss(logprobs, old, advantages, torch.ones_like(old))
    expected = sum(c[2] for c in CASES) / len(CASES)
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)
    assert out.clipfrac.item() == pytest.approx(2 / 6)
    ratios = torch.tensor([c[1] for c in CASES])
    assert out.approx_kl.item() == pytest.approx(float((ratios - 1 - ratios.log()).mean()), abs=1e-5)
    out.loss.backward()
    # d(-A r)/d logprob = -A r where unclipped, 0 where a clip binds
    expected_grad = [0.0 if clipped else -a * r / len(CASES) for a, r, _, clipped in CASES]
    assert torch.allclose(logprobs.grad[0], torch.tensor(expected_grad), atol=1e-5)


def test_clip_high_is_separate_from_clip_low():
    logprobs, old, advantages = case_tensors([(1.0, 1.5, None, None), (-1.0, 0.5, None, None)])
    out = ppo_clip_loss(logprobs, old, advantages, torch.ones_like(old), clip_low=0.1, clip_high=0.28)
    assert out.loss.item() == pytest.approx((-1.28 + 0.9) / 2, abs=1e-5)


def test_dual_clip_bounds_negative_advantage_tokens():
    cases = [(-2.0, 5.0, 6.0, True), (-1.0, 1.5, 1.5, False), (1.0, 5.0, -1.2, True)]
    logprobs, old, advantages = case_tensors(cases)
    out = ppo_clip_loss(logprobs, old, advantages, torch.ones_like(old), dual_clip=3.0)
    assert out.loss.item() == pytest.approx((6.0 + 1.5 - 1.2) / 3, abs=1e-5)
    assert out.clipfrac.item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logprobs, old, advantages, torch.ones_like(old), dual_clip=0.5)


def test_masked_tokens_do_not_count_and_extreme_log_ratios_stay_finite():
    logprobs, old, advantages = case_tensors(CASES[:2])
    logprobs = torch.cat([logprobs, torch.tensor([[500.0]])], dim=1)  # garbage outside the mask
    old = torch.cat([old, torch.tensor([[-500.0]])], dim=1)
    advantages = torch.cat([advantages, torch.tensor([[-1.0]])], dim=1)
    out = ppo_clip_loss(logprobs, old, advantages, torch.tensor([[1.0, 1.0, 0.0]]))
    assert out.loss.item() == pytest.approx((-1.1 - 1.2) / 2, abs=1e-5)
    assert math.isfinite(out.approx_kl.item())


LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, norm_length, expected",
    [
        ("token-mean", None, (1 + 2 + 3 + 5) / 4),
        ("seq-mean-token-mean", None, ((1 + 2 + 3) / 3 + 5) / 2),  # the empty row is not a sequence
        ("seq-mean-token-sum-norm", None, (6 / 4 + 5 / 4) / 2),  # default length: the width L = 4
        ("seq-mean-token-sum-norm", 10.0, (6 / 10 + 5 / 10) / 2),
    ],
)
def test_aggregation_modes_by_hand(mode, norm_length, expected):
    assert aggregate_loss(LOSS, MASK, mode, norm_length=norm_length).item() == pytest.approx(expected)


def test_aggregation_uses_given_normalizers_and_rejects_unknown_modes():
    assert aggregate_loss(LOSS, MASK, "token-mean", num_tokens=11.0).item() == pytest.approx(11 / 11)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-mean", num_sequences=4.0).item() == pytest.approx(7 / 4)
    assert set(LOSS_AGG_MODES.names()) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    with pytest.raises(UnknownNameError, match="seq-mean-token-mean"):
        aggregate_loss(LOSS, MASK, "sequence-mean")


def test_policy_losses_are_registered_and_unknown_names_list_the_valid_ones():
    assert POLICY_LOSSES.names() == ["gspo", "ppo_clip"]
    assert POLICY_LOSSES.get("ppo_clip") is ppo_clip_loss
    with pytest.raises(UnknownNameError, match="unknown policy loss 'ppo'; valid policy loss names: gspo, ppo_clip"):
        POLICY_LOSSES.get("ppo")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_normalizers_equal_one_batch(mode):
    gen = torch.Generator().manual_seed(0)
    rows, width = 7, 9
    old = -torch.rand(rows, width, generator=gen) * 3
    logprobs = (old + torch.randn(rows, width, generator=gen) * 0.3).requires_grad_(True)
    advantages = torch.randn(rows, width, generator=gen)
    lengths = [9, 3, 6, 1, 8, 2, 5]
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    mask[3] = 0.0  # a row with no loss token
    kwargs = dict(agg_mode=mode, clip_low=0.2, clip_high=0.3)

    whole = ppo_clip_loss(logprobs, old, advantages, mask, norm_length=12.0, **kwargs).loss
    (whole_grad,) = torch.autograd.grad(whole, logprobs)

    norms = dict(num_tokens=float(mask.sum()), num_sequences=float((mask.sum(1) > 0).sum()), norm_length=12.0)
    total = torch.zeros(())
    for chunk, cut in (([0, 4], width), ([1, 2, 5], 6), ([3, 6], 5)):  # different padded widths
        idx = torch.tensor(chunk)
        total = total + ppo_clip_loss(
            logprobs[idx, :cut], old[idx, :cut], advantages[idx, :cut], mask[idx, :cut], **kwargs, **norms
        ).loss
    (micro_grad,) = torch.autograd.grad(total, logprobs)
    assert total.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(micro_grad, whole_grad, atol=1e-7)


def grad_wrt_logprobs(old, advantages, loss_mask):
    logprobs = old.clone().requires_grad_(True)  # ratio 1 everywhere: d loss / d logprob_t = -A_t / n
    ppo_clip_loss(logprobs, old, advantages, loss_mask).loss.backward()
    return logprobs.grad


# A packed row: first prompt (2 tokens), action, two observation tokens, action. Every token
# carries the advantage the advantages stage stored for it: the episode's 0.6 on the actions and,
# with the loss mask off, on the observations too (agent_core.algos.step_advantages).
ACTION = torch.tensor([[0, 0, 1, 0, 0, 1]])
OLD = torch.tensor([[0.0, -0.9, -0.6, -2.0, -1.1, -1.4]])
ADVANTAGES = torch.tensor([[0.0, 0.0, 0.6, 0.6, 0.6, 0.6]])


def test_loss_mask_off_trains_observation_tokens_with_their_advantage_by_hand():
    attention = torch.ones_like(ACTION)
    on = derive_masks(ACTION, attention, use_loss_mask=True, use_advantage_mask=True,
                      response_start=torch.tensor([2])).loss_mask
    off = derive_masks(ACTION, attention, use_loss_mask=False, use_advantage_mask=True,
                       response_start=torch.tensor([2])).loss_mask
    # token-mean over 2 action tokens: -0.6 / 2 on each action, nothing elsewhere
    assert torch.allclose(grad_wrt_logprobs(OLD, ADVANTAGES, on), torch.tensor([[0, 0, -0.3, 0, 0, -0.3]]))
    # over the 4 region tokens: -0.6 / 4 on actions and observations; the first prompt stays out
    assert torch.allclose(grad_wrt_logprobs(OLD, ADVANTAGES, off), torch.tensor([[0, 0, -0.15, -0.15, -0.15, -0.15]]))


def test_with_the_loss_mask_on_values_off_the_action_change_nothing():
    attention = torch.ones_like(ACTION)
    mask = derive_masks(ACTION, attention, use_loss_mask=True, use_advantage_mask=False,
                        response_start=torch.tensor([2])).loss_mask
    base = grad_wrt_logprobs(OLD, ADVANTAGES, mask)
    changed = ADVANTAGES.clone()
    changed[0, [0, 1, 3, 4]] = torch.tensor([2.0, -3.0, 1.0, 5.0])
    assert torch.equal(grad_wrt_logprobs(OLD, changed, mask), base)


def test_masked_mean_and_entropy():
    x = torch.tensor([[1.0, 2.0, 30.0]])
    assert masked_mean(x, torch.tensor([[1.0, 1.0, 0.0]])).item() == pytest.approx(1.5)
    assert masked_mean(x, torch.zeros(1, 3)).item() == 0.0
    assert masked_mean(x, torch.tensor([[1.0, 0.0, 1.0]]), dim=-1).tolist() == [15.5]
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1)) * 3
    probs = logits.softmax(-1)
    naive = -(probs * probs.log()).sum(-1)
    assert torch.allclose(entropy_from_logits(logits), naive, atol=1e-5)
    assert torch.allclose(entropy_from_logits(torch.zeros(1, 1, 8)), torch.tensor([[math.log(8)]]))


# --- KL estimators and the clipped value loss -------------------------------------------------

from agent_core.algos.kl import KL_ESTIMATORS, kl_penalty  # noqa: E402
from agent_core.algos.losses import clipped_value_loss  # noqa: E402


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    assert kl_penalty(logp, ref, "k1").tolist()[0] == pytest.approx([0.5, -1.0])
    assert kl_penalty(logp, ref, "k2").tolist()[0] == pytest.approx([0.125, 0.5])
    # k3 with log r = ref - logp = [-0.5, 1.0]: e^-0.5 + 0.5 - 1 and e - 1 - 1
    assert kl_penalty(logp, ref, "k3").tolist()[0] == pytest.approx([math.exp(-0.5) - 0.5, math.e - 2.0], abs=1e-6)
    assert set(KL_ESTIMATORS.names()) == {"k1", "k2", "k3"}
    with pytest.raises(UnknownNameError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")
    with pytest.raises(ValueError, match="share one shape"):
        kl_penalty(logp, ref[:, :1], "k1")


def test_k1_and_k3_are_unbiased_and_k3_never_negative():
    gen = torch.Generator().manual_seed(3)
    policy = torch.log_softmax(torch.randn(7, generator=gen), dim=0)
    reference = torch.log_softmax(torch.randn(7, generator=gen), dim=0)
    true_kl = float((policy.exp() * (policy - reference)).sum())
    for name in ("k1", "k3"):
        # expectation over tokens sampled from the policy = exact probability-weighted sum
        expected = float((policy.exp() * kl_penalty(policy[None], reference[None], name)[0]).sum())
        assert expected == pytest.approx(true_kl, abs=1e-5)
    assert torch.all(kl_penalty(policy[None], reference[None], "k3") >= 0)


def test_k3_stays_finite_for_extreme_log_ratios():
    logp = torch.tensor([[-200.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -200.0]])
    kl = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(kl).all()
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


VALUES = torch.tensor([[1.0, 2.0, 0.0]])
OLD_VALUES = torch.tensor([[0.5, 1.0, 0.0]])
RETURNS = torch.tensor([[2.0, 0.0, 1.0]])
VALUE_MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_clipped_value_loss_by_hand():
    values = VALUES.clone().requires_grad_(True)
    out = clipped_value_loss(values, OLD_VALUES, RETURNS, VALUE_MASK, clip_range=0.2)
    # token 0: plain (1-2)^2 = 1, clipped (0.5+0.2-2)^2 = 1.69 -> 1.69 (clip binds)
    # token 1: plain (2-0)^2 = 4, clipped (1.0+0.2-0)^2 = 1.44 -> 4; token 2 is masked out
    assert out.loss.item() == pytest.approx(0.5 * (1.69 + 4.0) / 2)
    assert out.clipfrac.item() == pytest.approx(0.5)
    out.loss.backward()
    # the clipped term has no gradient w.r.t. v once the clip binds; the plain one: (v - R) / 2 tokens
    assert values.grad.tolist()[0] == pytest.approx([0.0, 1.0, 0.0])
    unclipped = clipped_value_loss(VALUES, OLD_VALUES, RETURNS, VALUE_MASK, clip_range=None)
    assert unclipped.loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert unclipped.clipfrac.item() == 0.0


def test_clipped_value_loss_aggregates_by_mode_and_checks_inputs():
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # per token 0.5 * err^2: row 0 [0.5, 2.0], row 1 [2.0]
    seq_mean = clipped_value_loss(values, values, returns, mask, clip_range=None, agg_mode="seq-mean-token-mean")
    assert seq_mean.loss.item() == pytest.approx(((0.5 + 2.0) / 2 + 2.0) / 2)
    token_mean = clipped_value_loss(values, values, returns, mask, clip_range=None, num_tokens=6.0)
    assert token_mean.loss.item() == pytest.approx((0.5 + 2.0 + 2.0) / 6)
    with pytest.raises(ValueError, match="clip_range"):
        clipped_value_loss(values, values, returns, mask, clip_range=0.0)
    with pytest.raises(ValueError, match="share one"):
        clipped_value_loss(values, values[:, :2], returns, mask, clip_range=0.2)
