"""Training rows, micro-batches, token log-probs and the PPO step on a tiny real Llama."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_core.training.batches import TrainSequence, make_micro_batches, step_sequence
from agent_core.registry import UnknownNameError
from agent_core.training.settings import PPOSettings
from agent_core.training.scoring import score_logprobs, sequence_logprobs
from agent_core.training.trainer import make_optimizer, ppo_update

PAD = 0
UPDATE = PPOSettings(
    clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.0, max_grad_norm=None,
    micro_batch_tokens=4096, temperature=1.0, agg_mode="token-mean",
)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float()


def random_steps(seed: int, count: int = 5) -> list[TrainSequence]:
    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        prompt = [rng.randint(1, 63) for _ in range(rng.randint(2, 7))]
        response = [rng.randint(1, 63) for _ in range(rng.randint(1, 5))]
        logprobs = [-rng.uniform(2.0, 6.0) for _ in response]
        advantage = rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5)
        steps.append(step_sequence(prompt, response, logprobs, [advantage] * len(response)))
    return steps


def test_step_sequence_aligns_prompt_and_response():
    seq = step_sequence([5, 6, 7], [8, 9], [-0.5, -1.5], [2.0, 2.0])
    assert seq.input_ids == [5, 6, 7, 8, 9]
    assert seq.action_mask == [0, 0, 0, 1, 1]
    assert seq.old_logprobs == [0.0, 0.0, 0.0, -0.5, -1.5]
    assert seq.advantages == [0.0, 0.0, 0.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="response_logprobs 1"):
        step_sequence([5], [8, 9], [-0.5], [1.0, 1.0])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        step_sequence([], [8], [-0.5], [1.0])
    with pytest.raises(ValueError, match="advantages"):
        TrainSequence([1, 2], [0, 1], [0.0, -1.0], [0.0])


def test_micro_batches_respect_the_token_budget_and_keep_every_sequence():
    lengths = [3, 9, 4, 4, 2, 7, 1, 12]
    sequences = [TrainSequence(list(range(1, n + 1)), [0] + [1] * (n - 1), [-1.0] * n, [0.5] * n) for n in lengths]
    batches = make_micro_batches(sequences, max_tokens=10, pad_id=PAD)
    seen = sorted(i for b in batches for i in b.indices)
    assert seen == list(range(len(lengths)))
    for batch in batches:
        rows, width = batch.input_ids.shape
        assert rows * width <= 10 or rows == 1
        assert width == max(lengths[i] for i in batch.indices)
        assert batch.input_ids.dtype == torch.long and batch.attention_mask.dtype == torch.long
        assert batch.action_mask.dtype == torch.long and batch.old_logprobs.dtype == torch.float32
        for row, i in enumerate(batch.indices):
            n = lengths[i]
            assert batch.input_ids[row].tolist() == list(range(1, n + 1)) + [PAD] * (width - n)
            assert batch.attention_mask[row].tolist() == [1] * n + [0] * (width - n)
            assert batch.advantages[row].tolist() == [0.5] * n + [0.0] * (width - n)
    assert any(len(b.indices) == 1 and b.input_ids.shape[1] == 12 for b in batches)  # longer than the budget


def test_sequence_logprobs_match_a_naive_per_position_computation():
    model = tiny_llama().eval()
    batch = make_micro_batches(random_steps(1, count=4), max_tokens=4096, pad_id=PAD)[0]
    temperature = 0.7
    with torch.no_grad():
        logprobs, entropy = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)
        for row in range(batch.input_ids.shape[0]):
            n = int(batch.attention_mask[row].sum())
            assert logprobs[row, 0] == 0 and torch.all(logprobs[row, n:] == 0)
            for t in range(1, n):
                context = batch.input_ids[row, :t][None]  # unpadded prefix, its own forward pass
                dist = torch.log_softmax(model(input_ids=context).logits[0, -1] / temperature, dim=-1)
                target = batch.input_ids[row, t]
                assert logprobs[row, t].item() == pytest.approx(dist[target].item(), abs=1e-5)
                assert entropy[row, t].item() == pytest.approx(-(dist.exp() * dist).sum().item(), abs=1e-5)


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_one_update_changes_every_trainable_parameter():
    model = tiny_llama().eval()
    before = parameters(model)
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0)
    steps = random_steps(2)
    result = ppo_update(model, optimizer, steps, replace(UPDATE, max_grad_norm=1.0, entropy_coef=0.01),
                        pad_id=PAD)
    assert not result.skipped and result.skip_reason is None
    assert result.tokens == sum(sum(s.action_mask) for s in steps)
    assert result.lr == pytest.approx(1e-3)
    assert result.grad_norm > 0 and result.entropy > 0 and result.clipfrac >= 0
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p.detach(), before[name])]
    assert unchanged == []
    assert not model.training  # the previous mode is restored


def sgd_delta(steps, seed=0, **overrides) -> dict[str, torch.Tensor]:
    """Parameter change of one plain SGD step (lr 1): minus the accumulated gradient."""
    model = tiny_llama(seed)
    before = parameters(model)
    result = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), steps, replace(UPDATE, **overrides),
                        pad_id=PAD)
    assert not result.skipped
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}


def assert_same_deltas(a, b, same: bool):
    close = all(torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-4) for name in a)
    assert close == same


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_gives_the_same_step_as_one_batch(agg_mode):
    steps = random_steps(3, count=6)
    whole = sgd_delta(steps, agg_mode=agg_mode)
    micro = sgd_delta(steps, agg_mode=agg_mode, micro_batch_tokens=12)
    assert_same_deltas(whole, micro, same=True)


def with_prompt_values(steps, old_logprob: float, advantage: float, region_start=None) -> list[TrainSequence]:
    """Prompt positions get these values; region_start(prompt_len) sets where the response region starts."""
    changed = []
    for s in steps:
        prompt_len = s.action_mask.index(1)
        changed.append(TrainSequence(
            s.input_ids, s.action_mask,
            [old_logprob] * prompt_len + s.old_logprobs[prompt_len:],
            [advantage] * prompt_len + s.advantages[prompt_len:],
            response_start=None if region_start is None else region_start(prompt_len),
        ))
    return changed


def test_context_positions_get_no_gradient_with_masks_on_or_off():
    steps = random_steps(4)
    changed = with_prompt_values(steps, old_logprob=-1.3, advantage=0.8)
    assert_same_deltas(sgd_delta(steps), sgd_delta(changed), same=True)
    # masks off cover the response region only: a step row's prompt is context (no loss, no target)
    masks_off = dict(use_loss_mask=False, use_advantage_mask=False)
    assert_same_deltas(sgd_delta(steps, **masks_off), sgd_delta(changed, **masks_off), same=True)
    assert_same_deltas(sgd_delta(steps, **masks_off), sgd_delta(steps), same=True)


def test_prompt_suffix_in_the_response_region_is_trained_with_masks_off_only():
    steps = with_prompt_values(random_steps(4), old_logprob=0.0, advantage=0.0, region_start=lambda n: n - 1)
    changed = with_prompt_values(steps, old_logprob=-1.3, advantage=0.8, region_start=lambda n: n - 1)
    assert_same_deltas(sgd_delta(steps), sgd_delta(changed), same=True)
    masks_off = dict(use_loss_mask=False, use_advantage_mask=False)
    assert_same_deltas(sgd_delta(steps, **masks_off), sgd_delta(changed, **masks_off), same=False)
    # Off the action the engine gave no log-prob: the trainer uses the current policy's (ratio 1),
    # so changing that placeholder alone changes nothing.
    only_old = with_prompt_values(changed, old_logprob=-4.0, advantage=0.8, region_start=lambda n: n - 1)
    assert_same_deltas(sgd_delta(changed, **masks_off), sgd_delta(only_old, **masks_off), same=True)


def test_nan_advantage_skips_the_step_and_leaves_parameters_unchanged():
    model = tiny_llama()
    optimizer = make_optimizer(model, lr=1e-3)
    before = parameters(model)
    steps = random_steps(5)
    bad = steps[2]
    steps[2] = TrainSequence(bad.input_ids, bad.action_mask, bad.old_logprobs, bad.advantages[:-1] + [float("nan")])
    result = ppo_update(model, optimizer, steps, UPDATE, pad_id=PAD)
    assert result.skipped and "non-finite" in result.skip_reason
    assert all(torch.equal(p.detach(), before[name]) for name, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.state_dict()["state"] == {}


def test_update_without_loss_tokens_is_skipped():
    model = tiny_llama()
    empty = [step_sequence([3, 4, 5], [], [], []), step_sequence([7, 8], [], [], [])]
    result = ppo_update(model, make_optimizer(model, lr=1e-3), empty, UPDATE, pad_id=PAD)
    assert result.skipped and result.skip_reason == "no tokens in the loss mask"
    assert result.tokens == 0


# --- train_iteration: epochs, mini-batches, old log-probs, KL, critic, LR schedule --------------

import math  # noqa: E402

from agent_core.training.critic import value_model_from_policy  # noqa: E402
from agent_core.training.schedule import (  # noqa: E402
    LR_SCHEDULES, lr_multiplier, make_lr_scheduler, optimizer_step_count,
)
from agent_core.training.trainer import train_iteration  # noqa: E402

ITERATION = PPOSettings(max_grad_norm=1.0, micro_batch_tokens=24)


def full_steps(seed: int, count: int = 6, ref_from=None) -> list[TrainSequence]:
    """Steps with ref log-probs, values and returns (as the advantages stage stores them)."""
    rng = random.Random(seed)
    steps = []
    for base in random_steps(seed, count):
        n = sum(base.action_mask)
        prompt, response = base.input_ids[: len(base) - n], base.input_ids[len(base) - n:]
        steps.append(step_sequence(
            prompt, response, base.old_logprobs[len(prompt):], base.advantages[len(prompt):],
            ref_logprobs=[-rng.uniform(2.0, 6.0) for _ in range(n)], values=[rng.uniform(-1, 1) for _ in range(n)],
            returns=[rng.uniform(-1, 1) for _ in range(n)],
        ))
    return steps


def test_train_iteration_takes_one_step_per_mini_batch_and_is_seeded():
    steps = full_steps(10)
    runs = []
    for _ in range(2):
        model = tiny_llama()
        results = train_iteration(model, make_optimizer(model, lr=1e-3), steps,
                                  replace(ITERATION, epochs=2, mini_batches=3), pad_id=PAD, seed=7)
        runs.append(results)
    results = runs[0]
    assert len(results) == 6 and not any(r.skipped for r in results)
    action_tokens = sum(sum(s.action_mask) for s in steps)
    assert sum(r.tokens for r in results[:3]) == sum(r.tokens for r in results[3:]) == action_tokens
    assert all(math.isnan(r.vf_loss) and r.tokens_per_s > 0 and r.grad_norm > 0 for r in results)
    assert [r.loss for r in runs[0]] == [r.loss for r in runs[1]]  # same seed, same shuffle, same steps


def test_recomputed_old_logprobs_start_on_policy_and_rollout_ones_do_not():
    steps = random_steps(11)  # rollout log-probs far from the tiny model's (about -ln 64 = -4.2)
    first = {}
    for recompute in (True, False):
        model = tiny_llama()
        settings = replace(ITERATION, clip_low=0.01, clip_high=0.01, recompute_old_logprobs=recompute)
        first[recompute] = train_iteration(model, make_optimizer(model, lr=1e-3), steps, settings, pad_id=PAD)[0]
    assert first[True].kl == pytest.approx(0.0, abs=1e-6) and first[True].clipfrac == 0.0
    assert first[False].kl > 1e-3 and first[False].clipfrac >= 0.5  # 6 of its 12 tokens


def test_kl_to_the_reference_is_measured_and_its_term_moves_the_gradient():
    model = tiny_llama()
    steps = random_steps(12)
    own = score_logprobs(model, [s.input_ids for s in steps], PAD, 4096, 1.0)
    on_reference = [TrainSequence(s.input_ids, s.action_mask, s.old_logprobs, s.advantages, ref_logprobs=lp)
                    for s, lp in zip(steps, own)]
    [result] = train_iteration(model, make_optimizer(model, lr=1e-3), on_reference, replace(ITERATION, kl_coef=0.5),
                               pad_id=PAD)
    assert result.kl == pytest.approx(0.0, abs=1e-6)  # the policy IS the reference before the step
    far = full_steps(12)
    no_kl = sgd_delta(far)
    assert_same_deltas(no_kl, sgd_delta(far, kl_coef=0.0, kl_estimator="k2"), same=True)
    assert_same_deltas(no_kl, sgd_delta(far, kl_coef=0.5, kl_estimator="k3"), same=False)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        train_iteration(model, make_optimizer(model, lr=1e-3), steps, replace(ITERATION, kl_coef=0.1), pad_id=PAD)


def test_critic_trains_alongside_the_policy_and_its_non_finite_step_is_skipped():
    model = tiny_llama()
    critic = value_model_from_policy(model)
    steps = full_steps(13)
    results = train_iteration(model, make_optimizer(model, lr=1e-3), steps,
                              replace(ITERATION, epochs=6, value_clip=None), pad_id=PAD, critic=critic,
                              critic_optimizer=make_optimizer(critic, lr=1e-2))
    assert results[-1].vf_loss < 0.7 * results[0].vf_loss
    bad = list(steps)
    bad[0] = TrainSequence(bad[0].input_ids, bad[0].action_mask, bad[0].old_logprobs, bad[0].advantages,
                           bad[0].ref_logprobs, bad[0].old_values, bad[0].returns[:-1] + [float("nan")])
    head_before = critic.value_head.weight.detach().clone()
    [result] = train_iteration(model, make_optimizer(model, lr=1e-3), bad, ITERATION, pad_id=PAD, critic=critic,
                               critic_optimizer=make_optimizer(critic, lr=1e-2))
    assert result.skipped and math.isfinite(result.loss) and math.isnan(result.vf_loss)
    assert result.skip_reason.startswith("critic: non-finite")
    assert torch.equal(critic.value_head.weight, head_before)
    with pytest.raises(ValueError, match="old_values and returns"):
        train_iteration(model, make_optimizer(model, lr=1e-3), random_steps(1), ITERATION, pad_id=PAD, critic=critic,
                        critic_optimizer=make_optimizer(critic, lr=1e-2))
    assert len(train_iteration(model, make_optimizer(model, lr=1e-3), steps[:2], replace(ITERATION, mini_batches=9),
                               pad_id=PAD)) == 2
    with pytest.raises(ValueError, match="at least one training sequence"):
        train_iteration(model, make_optimizer(model, lr=1e-3), [], ITERATION, pad_id=PAD)


@pytest.mark.parametrize("name, step, expected", [
    ("constant", 0, 1 / 2), ("constant", 1, 1.0), ("constant", 50, 1.0),
    ("linear", 2, 1.0), ("linear", 7, 0.1 + 0.9 * 0.5), ("linear", 12, 0.1), ("linear", 99, 0.1),
    ("cosine", 2, 1.0), ("cosine", 7, 0.1 + 0.9 * 0.5), ("cosine", 12, 0.1),
    ("cosine", 4, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2))),
])
def test_lr_schedules_by_hand(name, step, expected):
    assert lr_multiplier(step, name=name, warmup_steps=2, total_steps=12, min_lr_ratio=0.1) == pytest.approx(expected)


def test_the_schedule_continues_across_iterations_from_the_optimizer_step_count():
    assert set(LR_SCHEDULES.names()) == {"constant", "linear", "cosine"}
    with pytest.raises(UnknownNameError, match="constant, cosine, linear"):
        lr_multiplier(0, name="exp", warmup_steps=0, total_steps=10)
    schedule = dict(name="linear", base_lr=1e-2, warmup_steps=1, total_steps=5)
    model = tiny_llama()
    optimizer = make_optimizer(model, lr=123.0)  # the schedule's base_lr wins over a stale group lr
    steps = random_steps(14)
    first = train_iteration(model, optimizer, steps, replace(ITERATION, mini_batches=2), pad_id=PAD,
                            scheduler=make_lr_scheduler(optimizer, start_step=0, **schedule))
    assert [r.lr for r in first] == pytest.approx([1e-2, 1e-2])
    assert optimizer_step_count(optimizer) == 2
    resumed = make_optimizer(model, lr=123.0)
    resumed.load_state_dict(optimizer.state_dict())  # what the next iteration restores from disk
    start = optimizer_step_count(resumed)
    second = train_iteration(model, resumed, steps, replace(ITERATION, mini_batches=2), pad_id=PAD,
                             scheduler=make_lr_scheduler(resumed, start_step=start, **schedule))
    assert [r.lr for r in second] == pytest.approx([1e-2 * 0.75, 1e-2 * 0.5])  # steps 2 and 3 of 1 + 4


def test_a_skipped_update_does_not_advance_the_schedule():
    model = tiny_llama()
    optimizer = make_optimizer(model, lr=1e-3)
    scheduler = make_lr_scheduler(optimizer, name="linear", base_lr=1e-2, warmup_steps=0, total_steps=4)
    empty = [step_sequence([3, 4, 5], [], [], []), step_sequence([7, 8], [], [], [])]
    [result] = train_iteration(model, optimizer, empty, ITERATION, pad_id=PAD, scheduler=scheduler)
    assert result.skipped and result.skip_reason == "no tokens in the loss mask"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2) and optimizer_step_count(optimizer) == 0


def test_micro_batches_are_capped_by_the_size_of_their_logits():
    from agent_core.training.scoring import vocab_capped_tokens

    assert vocab_capped_tokens(8192, 49152) == 2**26 // 49152 == 1365  # SmolLM2: 256 MiB of fp32 logits
    assert vocab_capped_tokens(8192, 400) == 8192  # a tiny vocabulary leaves the token budget alone
    assert vocab_capped_tokens(8192, 10**9) == 64  # never below one reasonable row
    assert vocab_capped_tokens(4096, 1000, max_logit_elements=1_000_000) == 1000
    assert vocab_capped_tokens(24, 10**9) == 24  # the cap never raises a smaller budget


def test_the_fused_optimizer_takes_the_steps_of_a_plain_adamw_and_loads_its_state():
    """make_optimizer's fused AdamW (one kernel per parameter) against torch's plain for-loop AdamW
    over three updates with weight decay: the same parameters up to float rounding, and a state saved
    by either loads into the other (old runs' optimizer.pt files resume)."""
    fused, plain = tiny_llama(3), tiny_llama(3)
    fused_opt = make_optimizer(fused, lr=1e-2, weight_decay=0.1)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused_opt.defaults["fused"] and not plain_opt.defaults["foreach"]
    for seed in (4, 5, 6):
        for model, optimizer in ((fused, fused_opt), (plain, plain_opt)):
            ppo_update(model, optimizer, random_steps(seed), replace(UPDATE, max_grad_norm=1.0), pad_id=PAD)
    moved = parameters(tiny_llama(3))
    for name, p in fused.named_parameters():
        expected = dict(plain.named_parameters())[name].detach()
        assert torch.allclose(p.detach(), expected, atol=1e-6, rtol=1e-5), name
        assert not torch.equal(p.detach(), moved[name])  # the steps did move it
    reloaded = make_optimizer(tiny_llama(3), lr=1e-2, weight_decay=0.1)
    reloaded.load_state_dict(plain_opt.state_dict())
    state = reloaded.state_dict()["state"]
    assert set(state) == set(plain_opt.state_dict()["state"]) and all(float(s["step"]) == 3 for s in state.values())
