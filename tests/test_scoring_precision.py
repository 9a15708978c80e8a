"""Scoring sized and computed like training (issue 38 item 4): reference / old log-probs and critic values under
the trainer's precision (its bf16 autocast) and in micro-batches sized from device memory, larger than training's
since no graph is kept. The CUDA memory query is replaced by a number here (there is no GPU)."""

from __future__ import annotations

import pytest
import torch

from agent_core.training import memory
from agent_core.training.critic import score_values, value_model_from_policy
from agent_core.training.memory import AUTO, MAX_TOKENS, resolve_micro_batch_tokens
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.precision import autocast
from agent_core.training.scoring import SCORING_MAX_TOKENS, score_logprobs, scoring_micro_batch_tokens, sequence_logprobs


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer(["<search>a</search> <answer>b</answer> the quick brown fox jumps"], vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # sharper logits: bf16 rounding shows in the log-probs
    return model.eval()


SEQUENCES = [[1, 7, 9, 30, 44, 12, 5, 80, 2], [1, 3, 4, 200, 17], [1, 99, 98, 97, 96, 95, 94]]
STARTS = [3, 2, 4]


def test_bf16_scoring_gives_the_trainers_autocast_logprobs_not_fp32s(policy):
    fp32 = score_logprobs(policy, SEQUENCES, 0, 4096, 1.0, starts=STARTS)
    bf16 = score_logprobs(policy, SEQUENCES, 0, 4096, 1.0, starts=STARTS, precision="bf16")
    assert fp32 != bf16  # the switch changes the computation
    for sequence, start, exact in zip(SEQUENCES, STARTS, fp32):
        ids = torch.tensor([sequence])
        with torch.no_grad(), autocast(ids.device, "bf16"):  # the trainer's forward (trainer.py), one row alone
            logprobs, _ = sequence_logprobs(policy, ids, torch.ones_like(ids), positions=torch.ones_like(ids))
        alone = score_logprobs(policy, [sequence], 0, 4096, 1.0, starts=[start], precision="bf16")[0]
        assert alone[start:] == pytest.approx(logprobs[0, start:].tolist(), abs=1e-5)
        assert alone[start:] == pytest.approx(exact[start:], abs=0.1)  # bf16 rounding, nothing else
    # auto on the CPU is fp32, as the CPU trainer computes
    assert score_logprobs(policy, SEQUENCES, 0, 4096, 1.0, starts=STARTS, precision="auto") == fp32


def test_critic_values_follow_the_precision_too(policy):
    critic = value_model_from_policy(policy).eval()
    with torch.no_grad():  # a fresh head outputs zeros in any precision
        for p in critic.value_head.parameters():
            p.copy_(torch.randn_like(p))
    fp32 = score_values(critic, SEQUENCES, 0, 4096)
    bf16 = score_values(critic, SEQUENCES, 0, 4096, precision="bf16")
    assert fp32 != bf16
    assert [len(v) for v in bf16] == [len(s) for s in SEQUENCES]


def test_auto_scoring_batches_are_sized_from_device_memory_and_larger_than_trainings(policy, monkeypatch):
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 80 * 2**30)  # as on an 80 GB card
    training = resolve_micro_batch_tokens(policy, AUTO, AUTO, training=True, precision="bf16")
    scoring = scoring_micro_batch_tokens(policy, AUTO, "bf16")
    assert training == MAX_TOKENS and scoring == SCORING_MAX_TOKENS > training
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 2**30 + 64 * 2**20)  # little room left
    small_fp32, small_bf16 = scoring_micro_batch_tokens(policy, AUTO, "fp32"), scoring_micro_batch_tokens(
        policy, AUTO, "bf16")
    assert small_fp32 <= small_bf16 < SCORING_MAX_TOKENS  # bf16 activations take less room per token
    assert scoring_micro_batch_tokens(policy, 1024, "bf16") == 1024  # an explicit size always wins
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: None)  # the CPU: the constant, as before
    assert scoring_micro_batch_tokens(policy, AUTO, "bf16") == memory.CPU_MICRO_BATCH_TOKENS
