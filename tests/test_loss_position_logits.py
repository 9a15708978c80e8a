"""Logits only at loss positions (agent_core.training.scoring.split_lm_head): the same log-probs,
entropies, loss, metrics and gradients as full [B, L, V] logits, with the LM head run on fewer rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_core.training import scoring, trainer
from agent_core.training.batches import TrainSequence, make_micro_batches
from agent_core.training.settings import PPOSettings
from agent_core.training.scoring import score_logprobs, sequence_logprobs, split_lm_head
from agent_core.training.trainer import make_optimizer, ppo_update

PAD = 0


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).float()


def rows(seed: int = 0) -> list[TrainSequence]:
    """Multi-step-like rows: actions interleaved with observations, varied lengths, old/ref log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in (9, 14, 6, 11):
        ids = torch.randint(1, 64, (length,), generator=g).tolist()
        action = [0, 0, 0] + [int(x) for x in (torch.rand(length - 3, generator=g) > 0.4).tolist()]
        old = [(-torch.rand(1, generator=g).item() * 4 if a else 0.0) for a in action]
        adv = [(torch.randn(1, generator=g).item() if a else 0.0) for a in action]
        ref = [(-torch.rand(1, generator=g).item() * 4 if a else 0.0) for a in action]
        out.append(TrainSequence(ids, action, old, adv, ref_logprobs=ref))
    return out


def head_rows(model) -> list[int]:
    """Runs `model`'s LM head is called on, as the number of rows of its input."""
    seen: list[int] = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].reshape(-1, 32).shape[0]))
    return seen


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selected_positions_give_the_full_values_and_gradients(temperature):
    batch = make_micro_batches(rows(), max_tokens=4096, pad_id=PAD)[0]
    positions = batch.action_mask > 0
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    grads, values = [], []
    for select in (None, positions):
        model = tiny_llama()
        logprobs, entropy = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature,
                                              positions=select)
        mask = positions.float()
        ((logprobs * weights * mask).sum() + (entropy * mask).sum()).backward()
        values.append((logprobs * mask, entropy * mask))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    full, selected = values
    assert torch.allclose(full[0], selected[0], atol=1e-5) and torch.allclose(full[1], selected[1], atol=1e-5)
    assert selected[0][~positions].abs().max() == 0  # nothing is computed elsewhere
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4), name


def test_the_head_runs_only_on_the_selected_tokens():
    batch = make_micro_batches(rows(), max_tokens=4096, pad_id=PAD)[0]
    model = tiny_llama()
    seen = head_rows(model)
    sequence_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.action_mask > 0)
    sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    assert seen == [int((batch.action_mask[:, 1:] > 0).sum()), batch.input_ids.numel()]


def test_an_unknown_architecture_falls_back_to_full_logits():
    model = tiny_llama()
    assert split_lm_head(model) is not None
    model.config.model_type = "softcapped"  # its logits might be transformed after the head
    assert split_lm_head(model) is None
    seen = head_rows(model)
    batch = make_micro_batches(rows(), max_tokens=4096, pad_id=PAD)[0]
    sequence_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.action_mask > 0)
    assert seen == [batch.input_ids.numel()]


@pytest.mark.parametrize("use_loss_mask", [True, False])
def test_a_ppo_step_is_the_same_with_and_without_full_logits(monkeypatch, use_loss_mask):
    """Loss, metrics and the parameters after one step (entropy bonus and KL term on, two
    micro-batches) match; only the head's row count differs."""
    settings = PPOSettings(entropy_coef=0.01, kl_coef=0.1, max_grad_norm=None, micro_batch_tokens=30,
                           temperature=0.9, use_loss_mask=use_loss_mask)
    results, params, head_calls = [], [], []
    for split in (True, False):
        if not split:
            monkeypatch.setattr(scoring, "split_lm_head", lambda model: None)
        model = tiny_llama()
        seen = head_rows(model)
        results.append(ppo_update(model, make_optimizer(model, lr=1e-2), rows(), settings, pad_id=PAD))
        params.append([p.detach().clone() for p in model.parameters()])
        head_calls.append(sum(seen))
    with_split, full = results
    assert not with_split.skipped and with_split.tokens == full.tokens
    for field in ("loss", "pg_loss", "entropy", "kl", "clipfrac", "grad_norm"):
        assert getattr(with_split, field) == pytest.approx(getattr(full, field), rel=1e-4, abs=1e-6), field
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*params))
    assert head_calls[0] < head_calls[1]
    assert trainer.sequence_logprobs is scoring.sequence_logprobs  # the trainer goes through this switch


def saved_bytes_of_an_update(checkpointing: bool) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd keeps for the backward pass during one ppo_update, and the parameters after it."""
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    model = tiny_llama()
    settings = PPOSettings(max_grad_norm=None, activation_checkpointing=checkpointing)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = ppo_update(model, make_optimizer(model, lr=1e-2), rows(), settings, pad_id=PAD)
    assert not result.skipped
    assert not model.is_activation_checkpointing  # switched off again after the update
    return saved[0], [p.detach().clone() for p in model.parameters()]


def test_activation_checkpointing_keeps_less_and_takes_the_same_step():
    plain_bytes, plain = saved_bytes_of_an_update(False)
    checkpointed_bytes, checkpointed = saved_bytes_of_an_update(True)
    assert checkpointed_bytes < plain_bytes / 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, checkpointed))


def test_scoring_from_a_start_gives_the_full_scores_from_there_on():
    sequences = [r.input_ids for r in rows()]
    starts = [3, 9, 1, 11]  # the last: its final token only
    model = tiny_llama()
    seen = head_rows(model)
    full = score_logprobs(model, sequences, PAD, 4096, 0.8)
    tail = score_logprobs(model, sequences, PAD, 4096, 0.8, starts=starts)
    for f, t, start in zip(full, tail, starts):
        assert len(t) == len(f) and t[:start] == [0.0] * start
        assert t[start:] == pytest.approx(f[start:], abs=1e-5)
    assert seen[1] == sum(len(s) - start for s, start in zip(sequences, starts))


def test_bf16_precision_runs_the_matmuls_in_bfloat16_and_keeps_fp32_state():
    """precision=bf16 is autocast: bfloat16 layer outputs, fp32 weights, gradients' step and metrics
    close to fp32's (bfloat16 keeps ~3 significant digits)."""
    out_dtypes, results, params = [], [], []
    for precision in ("fp32", "bf16"):
        model = tiny_llama()
        hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda module, args, out: out_dtypes.append(out.dtype))
        settings = PPOSettings(max_grad_norm=None, precision=precision)
        results.append(ppo_update(model, make_optimizer(model, lr=1e-3), rows(), settings, pad_id=PAD))
        hook.remove()
        params.append([p.detach().clone() for p in model.parameters()])
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert out_dtypes == [torch.float32, torch.bfloat16]
    fp32, bf16 = results
    assert not bf16.skipped and bf16.loss == pytest.approx(fp32.loss, rel=0.05, abs=0.02)
    assert any(not torch.equal(a, b) for a, b in zip(*params))  # the switch changed the arithmetic
    with pytest.raises(ValueError, match="choose one of fp32, bf16"):
        ppo_update(tiny_llama(), make_optimizer(tiny_llama(), lr=1e-3), rows(), PPOSettings(precision="fp16"), pad_id=PAD)
