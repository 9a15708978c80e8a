"""Micro-batch sizing from device memory (agent_core/training/memory.py) and the out-of-memory split
and retry (agent_core/training/oom.py), on the CPU: the CUDA query is a seam the tests replace, and
the out-of-memory errors are injected."""

from __future__ import annotations

import random
from dataclasses import asdict, replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_core.io.tables import read_table, write_table
from agent_core.training import memory, trainer
from agent_core.training.batches import step_sequence
from agent_core.training.critic import value_model_from_policy
from agent_core.training.memory import ModelShape, micro_batch_token_budget, pending_state_bytes
from agent_core.training.oom import MicroBatchOutOfMemory
from agent_core.training.scoring import score_logprobs
from agent_core.training.settings import PPOSettings
from agent_core.training.trainer import make_optimizer, ppo_update, train_iteration

GB, GIB = 10**9, 2**30
# Qwen2.5-0.5B: hidden 896, 24 layers, vocabulary 151,936, MLP 4,864, 494M parameters.
QWEN_05B = ModelShape(hidden_size=896, layers=24, vocab_size=151_936, intermediate_size=4864, parameters=494_032_768)
FP32_WEIGHTS = 4 * QWEN_05B.parameters
GRADS_AND_ADAMW = 3 * FP32_WEIGHTS  # not yet allocated before the first step
PAD = 0
SETTINGS = PPOSettings(max_grad_norm=None, micro_batch_tokens=48, entropy_coef=0.01)


def tiny_llama(seed: int = 0, vocab: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).float()


def sequences(seed: int = 0, count: int = 10):
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = [rng.randint(1, 63) for _ in range(rng.randint(2, 6))]
        response = [rng.randint(1, 63) for _ in range(rng.randint(2, 5))]
        rows.append(step_sequence(prompt, response, [-rng.uniform(2, 5) for _ in response],
                                  [rng.choice([-1.0, 1.0])] * len(response)))
    return rows


def budget(free_bytes, shape=QWEN_05B, **kwargs):
    return micro_batch_token_budget(free_bytes, shape, **{"pending_bytes": GRADS_AND_ADAMW, "loss_fraction": 0.5,
                                                           **kwargs})


# ---- the pure function ------------------------------------------------------------------------

def test_the_budget_grows_with_free_memory_and_stays_in_its_bounds():
    values = [budget(free) for free in range(0, 200 * GB, GB // 2)]
    assert values == sorted(values)
    assert values[0] == memory.MIN_TOKENS and values[-1] == memory.MAX_TOKENS
    assert len(set(values)) > 20
    assert all(v % memory.ROUND_TO == 0 for v in values)


def test_an_explicit_setting_always_wins():
    assert budget(80 * GB, explicit=1234) == 1234
    assert budget(0, explicit=100_000) == 100_000


def test_a_bigger_vocabulary_or_more_layers_gives_a_smaller_budget():
    free = 40 * GB
    assert budget(free, replace(QWEN_05B, vocab_size=256_000)) < budget(free)
    assert budget(free, replace(QWEN_05B, layers=48)) < budget(free)
    assert budget(free, loss_fraction=1.0) < budget(free)
    assert budget(free, checkpointing=True) > budget(free)
    assert budget(free, precision="fp32") < budget(free, precision="bf16")


def test_qwen_half_b_shape_budgets_are_plausible_at_80_and_24_gb():
    # H100 80 GB: 16,384-token micro-batches ran (~60k tokens/s); 24 GiB: 8,192 ran out of memory.
    assert budget(80 * GB - FP32_WEIGHTS) >= 16_384
    assert budget(24 * GIB - FP32_WEIGHTS) <= 8192
    assert budget(24 * GIB - FP32_WEIGHTS, loss_fraction=0.25) <= 8192
    assert budget(24 * GIB - FP32_WEIGHTS, loss_fraction=1.0) >= memory.MIN_TOKENS


def test_the_shape_and_the_pending_optimizer_state_are_read_from_the_model():
    policy = tiny_llama()
    shape = ModelShape.of(policy)
    assert (shape.hidden_size, shape.layers, shape.vocab_size, shape.intermediate_size) == (32, 2, 64, 64)
    assert shape.parameters == sum(p.numel() for p in policy.parameters())
    assert ModelShape.of(value_model_from_policy(policy)).vocab_size == 0  # a critic has no logits
    optimizer = make_optimizer(policy, lr=1e-3)
    weights = 4 * shape.parameters
    assert pending_state_bytes(policy, optimizer) == 3 * weights  # gradients + AdamW's two moments
    ppo_update(policy, optimizer, sequences(), SETTINGS, pad_id=PAD)
    assert pending_state_bytes(policy, optimizer) == weights  # the moments exist; gradients were freed


# ---- wiring: the trainer asks the device on CUDA, nothing on the CPU ----------------------------

def _used_budgets(monkeypatch) -> list[int]:
    used = []
    prepare = trainer.prepare_update

    def spy(*args, micro_batch_tokens, **kwargs):
        used.append(micro_batch_tokens)
        return prepare(*args, micro_batch_tokens=micro_batch_tokens, **kwargs)

    monkeypatch.setattr(trainer, "prepare_update", spy)
    return used


def _train(settings: PPOSettings, policy=None, optimizer=make_optimizer):
    """train_iteration on tiny_llama(0) (or `policy`); SGD (`_sgd`) makes each parameter's change
    proportional to its gradient, so an update of wrong gradients cannot match (AdamW's first
    step moves by lr x the gradient's sign)."""
    policy = policy if policy is not None else tiny_llama()
    results = train_iteration(policy, optimizer(policy, lr=1e-2), sequences(), settings, pad_id=PAD)
    return policy, results


def _sgd(policy, lr):
    return torch.optim.SGD(policy.parameters(), lr=10 * lr)


def test_on_the_cpu_auto_is_the_old_constant_and_no_device_is_asked(monkeypatch):
    used = _used_budgets(monkeypatch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("the CPU asked for CUDA memory"))
    _train(replace(SETTINGS, micro_batch_tokens="auto", mini_batches=1))
    assert used == [8192]
    _train(replace(SETTINGS, micro_batch_tokens="auto", max_logit_elements=64 * 100, mini_batches=1))
    assert used[-1] == 100  # capped at 100 tokens x 64 vocabulary, as before "auto"


def test_on_cuda_auto_comes_from_free_memory_and_an_explicit_setting_wins(monkeypatch):
    used = _used_budgets(monkeypatch)
    free = {"bytes": GIB + 10 * 2**20}
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: free["bytes"])
    auto = replace(SETTINGS, micro_batch_tokens="auto", mini_batches=1, max_logit_elements="auto")
    _train(auto)
    policy = tiny_llama()
    expected = micro_batch_token_budget(free["bytes"], ModelShape.of(policy), precision="fp32",
                                        pending_bytes=3 * 4 * ModelShape.of(policy).parameters,
                                        loss_fraction=max(sum(q.action_mask) / len(q) for q in sequences()))
    assert used == [expected] and expected not in (8192, memory.MIN_TOKENS, memory.MAX_TOKENS)
    free["bytes"] += 10 * 2**20
    _train(auto)
    assert used[-1] > expected  # more free memory, bigger micro-batches
    _train(replace(auto, micro_batch_tokens=3000))
    assert used[-1] == 3000  # the user's setting, not the device's
    _train(replace(auto, micro_batch_tokens=3000, max_logit_elements=64 * 100))
    assert used[-1] == 100  # a logits cap the user set still applies


# ---- out of memory: split, retry, record ------------------------------------------------------

def _fail_once(module, when, error=torch.OutOfMemoryError):
    """Make module's forward raise `error` the first time when(input_ids) holds; record every call's
    padded tokens."""
    calls, original = [], module.forward

    def forward(*args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append(input_ids.numel())
        if when(input_ids) and not any(isinstance(c, str) for c in calls):
            calls.append("failed")
            raise error("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        return original(*args, **kwargs)

    module.forward = forward
    return calls


def _parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_update(policy, reference):
    before = _parameters(tiny_llama())
    moved = max(float((want - start).abs().max()) for want, start in zip(_parameters(reference), before))
    assert moved > 1e-3  # the tolerance below is far below what one update moves
    for got, want in zip(_parameters(policy), _parameters(reference)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_micro_batch_that_runs_out_of_memory_is_split_with_the_same_update(tmp_path):
    settings = replace(SETTINGS, mini_batches=2)
    reference, clean = _train(settings, optimizer=_sgd)
    policy = tiny_llama()
    calls = _fail_once(policy.model, lambda ids: ids.shape[0] > 1)
    _, results = _train(settings, policy, optimizer=_sgd)
    failed_at = calls.index("failed")
    assert [r.oom_splits for r in results] == [1, 0]
    assert all(c <= calls[failed_at - 1] // 2 for c in calls[failed_at + 1:])  # later micro-batches: smaller
    _assert_same_update(policy, reference)
    assert [r.loss for r in results] == pytest.approx([r.loss for r in clean], rel=1e-5)
    rows = [{"run_id": "r", "iteration": 0, "update_idx": i, **asdict(r), "started_at": 0.0, "finished_at": 1.0}
            for i, r in enumerate(results)]  # as tasks/train.py writes them
    uri = write_table("train_metrics", rows, tmp_path / "train_metrics.parquet")
    assert read_table("train_metrics", uri).column("oom_splits").to_pylist() == [1, 0]


def test_out_of_memory_in_the_backward_restarts_the_step_without_double_counting():
    reference, _ = _train(SETTINGS, optimizer=_sgd)
    policy = tiny_llama()
    failed = []

    def hook(grad):  # fires mid-backward: the LM head and the last layer already hold gradients
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the backward)")
        return grad

    policy.model.layers[0].self_attn.q_proj.weight.register_hook(hook)
    _, results = _train(SETTINGS, policy, optimizer=_sgd)
    assert failed and sum(r.oom_splits for r in results) == 1
    _assert_same_update(policy, reference)


def test_one_sequence_that_does_not_fit_says_what_to_set():
    policy = tiny_llama()
    _fail_once(policy.model, lambda ids: True)
    with pytest.raises(MicroBatchOutOfMemory, match=r"^out of memory on cpu training one sequence of \d+ tokens "
                                                    r"alone; set trainer.activation_checkpointing: true") as error:
        ppo_update(policy, make_optimizer(policy, lr=1e-2), sequences(count=1), SETTINGS, pad_id=PAD)
    assert "\n" not in str(error.value)


def test_reference_scoring_splits_out_of_memory_micro_batches_too():
    policy = tiny_llama()
    rows = [q.input_ids for q in sequences()]
    starts = [3] * len(rows)
    want = score_logprobs(policy, rows, PAD, 48, 1.0, starts=starts)
    calls = _fail_once(policy.model, lambda ids: ids.shape[0] > 1)
    got = score_logprobs(policy, rows, PAD, 48, 1.0, starts=starts)
    assert "failed" in calls
    for a, b in zip(got, want):
        assert a == pytest.approx(b, abs=1e-5)


def test_an_old_train_metrics_table_without_the_column_reads_as_zero(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from schemas import table_from_rows
    row = {"run_id": "r", "iteration": 0, "update_idx": 0, "loss": 0.5, "pg_loss": 0.4, "vf_loss": None,
           "entropy": 1.0, "kl": 0.0, "clipfrac": 0.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 10,
           "tokens_per_s": 1.0, "seconds": 1.0, "skipped": False, "skip_reason": None, "started_at": 0.0,
           "finished_at": 1.0}
    old = table_from_rows("train_metrics", [row]).drop_columns(["oom_splits"])
    assert "oom_splits" not in old.column_names
    path = tmp_path / "train_metrics.parquet"
    pq.write_table(pa.Table.from_arrays(old.columns, names=old.column_names), path)
    assert read_table("train_metrics", path).column("oom_splits").to_pylist() == [0]


def test_data_parallel_ranks_agree_on_the_smallest_budget():
    class TwoRanks:  # rank 1's view; rank 0 reports 2048 tokens (e.g. after an out-of-memory split)
        rank, world_size = 1, 2

        def sum_floats(self, values):
            return [values[0] + 2048.0, values[1]]

    assert trainer._agreed_tokens(8192, TwoRanks()) == 2048
    assert trainer._agreed_tokens(1024, TwoRanks()) == 1024
    assert trainer._agreed_tokens(8192, None) == 8192


def test_free_memory_respects_a_per_process_memory_fraction(monkeypatch):
    """`mem_get_info` reports the card's free memory even when the process is limited (a 24 GiB share
    of an 80 GB card): the budget must follow the limit, not the card."""
    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0, raising=False)
    assert memory.device_free_bytes("cuda:0") == 72 * gib  # no limit: the driver's free + the cache's unused
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.3, raising=False)
    assert memory.device_free_bytes("cuda:0") == 20 * gib  # 0.3 x 80 GiB = 24 GiB, 4 of them allocated
