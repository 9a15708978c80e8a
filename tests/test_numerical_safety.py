"""Numerical safety (agent_core/training/safety.py): non-finite inputs, log-probs, losses and gradients
skip the update with a reason that names them; repeated skips or a broken model stop the train
stage before anything is written. Tiny real Llamas throughout."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agent_core.config import AlgorithmConfig, TrainerConfig
from agent_core.io import background
from agent_core.io.checkpoints import load_policy, save_policy
from agent_core.io.layout import RunLayout
from agent_core.io.tables import read_table, table_exists, write_table
from agent_core.training.batches import TrainSequence
from agent_core.training.critic import value_model_from_policy
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.safety import (
    NonFiniteTrainingError, check_nonfinite_updates, check_savable, nonfinite_parameters, nonfinite_streaks,
    probe_logprobs,
)
from agent_core.training.trainer import UpdateResult, make_optimizer, ppo_update, train_iteration
from schemas import TableValidationError
import agent_core.training.trainer
from tasks.train import train_policy
from test_schemas import steps_rows
from test_trainer import ITERATION, PAD, UPDATE, full_steps, parameters, random_steps, tiny_llama

NAMES = {"advantages": "advantages", "old_logprobs": "old log-probs", "ref_logprobs": "reference log-probs"}


def _poison(sequence: TrainSequence, field: str, value: float) -> TrainSequence:
    """`value` on the sequence's last token (an action token) in `field`."""
    values = list(getattr(sequence, field))
    values[-1] = value
    return replace(sequence, **{field: values})


def _assert_untouched(model, optimizer, before) -> None:
    for name, p in model.named_parameters():  # nan != nan: compare with equal_nan
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, equal_nan=True)
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.state_dict()["state"] == {}


# --- one update: what was non-finite is named, nothing is stepped ------------------------------


@pytest.mark.parametrize("field", ["advantages", "old_logprobs", "ref_logprobs"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_input_skips_the_update_and_names_it(field, value):
    model = tiny_llama()
    optimizer = make_optimizer(model, lr=1e-3)
    before = parameters(model)
    steps = full_steps(3)
    steps[2] = _poison(steps[2], field, value)
    result = ppo_update(model, optimizer, steps, UPDATE, pad_id=PAD)
    assert result.skipped and result.skip_reason.startswith(f"non-finite inputs ({NAMES[field]}")
    assert result.skip_reason.endswith(": 1 values)")
    assert math.isnan(result.loss) and math.isnan(result.grad_norm)
    _assert_untouched(model, optimizer, before)


def test_an_infinite_old_logprob_no_longer_steps_silently():
    """+inf old log-prob: ratio exp(-inf) = 0 gives a FINITE clipped loss, so only the input check
    stops it (the loss and gradient-norm checks alone took this step)."""
    model = tiny_llama()
    steps = random_steps(4)
    steps[0] = _poison(steps[0], "old_logprobs", math.inf)
    result = ppo_update(model, make_optimizer(model, lr=1e-3), steps, UPDATE, pad_id=PAD)
    assert result.skipped and "old log-probs" in result.skip_reason


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_poisoned_weights_give_non_finite_log_probs_and_skip_the_update(value):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = value
    optimizer = make_optimizer(model, lr=1e-3)
    before = parameters(model)
    [result] = train_iteration(model, optimizer, random_steps(5), ITERATION, pad_id=PAD)
    assert result.skipped and result.skip_reason.startswith("non-finite log-probs from the model on ")
    assert "weights or activations overflowed" in result.skip_reason
    _assert_untouched(model, optimizer, before)
    # recomputed old log-probs come from the same broken model: the inputs check names them
    [recomputed] = train_iteration(model, optimizer, random_steps(5), replace(ITERATION, recompute_old_logprobs=True),
                                   pad_id=PAD)
    assert recomputed.skip_reason.startswith("non-finite inputs (old log-probs")


def test_the_critic_step_is_skipped_for_bad_returns_or_a_broken_value_head():
    model = tiny_llama()
    critic = value_model_from_policy(model)
    steps = full_steps(6)
    bad = list(steps)
    bad[1] = _poison(bad[1], "returns", math.inf)
    [result] = train_iteration(model, make_optimizer(model, lr=1e-3), bad, ITERATION, pad_id=PAD, critic=critic,
                               critic_optimizer=make_optimizer(critic, lr=1e-2))
    assert result.skip_reason == "critic: non-finite inputs (returns: 1 values)" and math.isfinite(result.loss)
    with torch.no_grad():
        critic.value_head.weight.fill_(math.nan)
    [result] = train_iteration(model, make_optimizer(model, lr=1e-3), steps, ITERATION, pad_id=PAD, critic=critic,
                               critic_optimizer=make_optimizer(critic, lr=1e-2))
    assert result.skip_reason.startswith("critic: non-finite values from the model")
    assert math.isfinite(result.loss)  # the policy step is independent of the critic's


def test_finite_updates_are_unaffected():
    model = tiny_llama()
    results = train_iteration(model, make_optimizer(model, lr=1e-3), full_steps(7),
                              replace(ITERATION, epochs=2, mini_batches=2, kl_coef=0.1), pad_id=PAD)
    assert not any(r.skipped for r in results) and all(math.isfinite(r.loss) for r in results)


# --- the checks the train stage runs before it saves --------------------------------------------


def _result(reason: str | None, lr: float = 1e-3) -> UpdateResult:
    nan = math.nan if reason else 0.5
    return UpdateResult(loss=nan, pg_loss=nan, vf_loss=math.nan, entropy=nan, kl=nan, clipfrac=nan, grad_norm=nan,
                        lr=lr, tokens=10, tokens_per_s=1.0, seconds=0.1, skipped=reason is not None,
                        skip_reason=reason)


def test_streaks_count_only_non_finite_skips_and_continue_the_previous_iteration():
    bad, empty = "non-finite loss (nan) in a micro-batch", "no tokens in the loss mask"
    assert nonfinite_streaks([None, bad, bad, None, bad]) == (2, 1)
    assert nonfinite_streaks([empty, empty, "critic: non-finite gradient norm (inf)"]) == (1, 1)
    assert nonfinite_streaks([bad, None], carried=3) == (4, 0)
    assert nonfinite_streaks([], carried=2) == (2, 2)


def test_too_many_non_finite_updates_in_a_row_raise_a_clear_error():
    bad = "non-finite log-probs from the model on 12 of 12 tokens (its weights or activations overflowed)"
    results = [_result(None, 1e30)] + [_result(bad, 1e30)] * 3
    assert check_nonfinite_updates(results, iteration=4, max_consecutive=3) == 3  # tolerated, carried on
    with pytest.raises(NonFiniteTrainingError) as error:
        check_nonfinite_updates(results, iteration=4, max_consecutive=2)
    message = str(error.value)
    for part in ("iteration 4", "3 of 4 updates", "3 in a row", "max_consecutive_nonfinite=2", f"3 x {bad!r}",
                 "Learning rate: 1e+30", "lower trainer.lr", "no checkpoint was written"):
        assert part in message
    with pytest.raises(NonFiniteTrainingError, match="after 2 at the end of the previous iteration"):
        check_nonfinite_updates([_result(bad)], iteration=5, max_consecutive=2, carried=2)
    assert check_nonfinite_updates([_result("no tokens in the loss mask")] * 9, iteration=0, max_consecutive=0) == 0


def test_a_model_is_savable_only_with_finite_parameters_and_log_probs():
    model = tiny_llama()
    check_savable(model.named_parameters(), iteration=0, probe_logprobs=probe_logprobs(model, [3, 4, 5, 6], 0))
    with torch.no_grad():
        model.lm_head.weight[7, 0] = math.inf
        model.model.norm.weight[0] = math.nan
    with pytest.raises(NonFiniteTrainingError, match=r"iteration 2: the critic has non-finite parameters after "
                                                     r"training \(model\.norm\.weight, lm_head\.weight\)"):
        check_savable(model.named_parameters(), iteration=2, what="critic")
    big = tiny_llama()
    assert not ppo_update(big, make_optimizer(big, lr=1e30), random_steps(8), UPDATE, pad_id=PAD).skipped
    assert nonfinite_parameters(big.named_parameters()) == []  # weights of ~1e30 are finite, their forward pass is not
    probe = probe_logprobs(big, [3, 4, 5, 6], 0)
    with pytest.raises(NonFiniteTrainingError, match="parameters are finite but its log-probs are not"):
        check_savable(big.named_parameters(), iteration=0, probe_logprobs=probe)


# --- the train stage on real tables -------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    tokenizer = build_tokenizer(["<search>a</search> <answer>b</answer> the quick brown fox"], vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("policy") / "initial")


def _run_with_tables(tmp_path: Path, iteration: int = 0) -> RunLayout:
    """A run with this iteration's steps (2 episodes x 3 steps) and finite GRPO-style advantages."""
    run = RunLayout(tmp_path, "r1")
    steps = [{**row, "iteration": iteration, "policy_version": iteration} for row in steps_rows()]
    write_table("steps", steps, run.table_uri(iteration, "steps"))
    advantages = [{"run_id": "r1", "iteration": iteration, "episode_id": s["episode_id"], "step_idx": s["step_idx"],
                   "advantages": [1.0, 1.0] if s["episode_id"] == "ep-0" else [-1.0, -1.0], "returns": [1.0, 1.0],
                   "values": None, "ref_logprobs": None, "obs_advantages": None, "obs_returns": None,
                   "obs_values": None, "estimator": "grpo"} for s in steps]
    write_table("advantages", advantages, run.table_uri(iteration, "advantages"))
    return run


def _train(run: RunLayout, policy: Path, iteration: int = 0, **trainer) -> str:
    cfg = TrainerConfig(**{"micro_batch_tokens": 64, "mini_batches": 1, **trainer})  # counts below assume 1 by default
    checkpoint = train_policy.fn(run, iteration, run.table_uri(iteration, "steps"),
                                 run.table_uri(iteration, "advantages"), str(policy), cfg,
                                 AlgorithmConfig(estimator="grpo"), 1.0)
    background.wait()  # the optimizer state (runtime.background_save), which the checks below read
    return checkpoint


def _nothing_written(run: RunLayout, iteration: int) -> bool:
    return not (run.checkpoint_dir(iteration).exists() or run.optimizer_state_path(iteration).exists()
                or table_exists(run.table_uri(iteration, "train_metrics")))


def test_the_tables_refuse_non_finite_values_before_training_sees_them(tmp_path):
    """In the pipeline the first line of defence is the schema: the trainer's checks are for what
    is computed after the tables are read (the model's own log-probs, the loss, the gradients)."""
    steps = steps_rows()
    steps[1]["response_logprobs"] = [-0.5, math.inf]
    with pytest.raises(TableValidationError, match="response_logprobs.*finite"):
        write_table("steps", steps, tmp_path / "steps.parquet")
    run = _run_with_tables(tmp_path)
    for column in ("advantages", "returns", "ref_logprobs", "values", "obs_returns"):
        rows = read_table("advantages", run.table_uri(0, "advantages")).to_pylist()
        rows[2][column] = [math.nan, 0.0]
        if column == "obs_returns":
            rows[2]["obs_advantages"] = [0.0, 0.0]
        with pytest.raises(TableValidationError, match=f"'{column}' failed check 'finite'"):
            write_table("advantages", rows, tmp_path / "advantages.parquet")


def test_a_finite_run_saves_its_checkpoint_and_metrics(tmp_path, policy_dir):
    run = _run_with_tables(tmp_path)
    checkpoint = _train(run, policy_dir, epochs=2, mini_batches=2)
    assert Path(checkpoint) == run.checkpoint_dir(0) and run.optimizer_state_path(0).is_file()
    metrics = read_table("train_metrics", run.table_uri(0, "train_metrics")).to_pylist()
    assert len(metrics) == 4 and not any(r["skipped"] or r["skip_reason"] for r in metrics)


def test_a_stray_non_finite_update_is_skipped_recorded_and_the_run_goes_on(tmp_path, policy_dir, monkeypatch):
    """The tables forbid nan/inf, so a bad value past them (e.g. a bug in an estimator) is simulated
    on the training sequences: its mini-batch is skipped, the other one trains."""
    real = agent_core.training.trainer.train_iteration  # what the "ppo" objective calls

    def with_a_bad_advantage(model, optimizer, sequences, settings, **kwargs):
        return real(model, optimizer, [_poison(sequences[0], "advantages", math.nan), *sequences[1:]], settings,
                    **kwargs)

    monkeypatch.setattr(agent_core.training.trainer, "train_iteration", with_a_bad_advantage)
    run = _run_with_tables(tmp_path)
    _train(run, policy_dir, mini_batches=2)
    assert run.checkpoint_dir(0).is_dir()
    metrics = read_table("train_metrics", run.table_uri(0, "train_metrics")).to_pylist()
    assert [r["skip_reason"] for r in metrics].count("non-finite inputs (advantages: 1 values)") == 1
    assert [r["skipped"] for r in metrics].count(False) == 1


def test_a_huge_learning_rate_stops_the_run_before_a_checkpoint_is_written(tmp_path, policy_dir):
    run = _run_with_tables(tmp_path)
    # one update: it is taken, leaves weights of ~1e30 (finite) whose forward pass is NaN: the probe sees it
    with pytest.raises(NonFiniteTrainingError, match="iteration 0: the policy's parameters are finite but its "
                                                     "log-probs are not"):
        _train(run, policy_dir, lr=1e30)
    assert _nothing_written(run, 0)
    # several updates: the first is taken, the other three are skipped, more than 2 in a row
    with pytest.raises(NonFiniteTrainingError, match=r"3 of 4 updates .* 3 in a row, more than "
                                                     r"trainer.max_consecutive_nonfinite=2"):
        _train(run, policy_dir, lr=1e30, epochs=4, max_consecutive_nonfinite=2)
    assert _nothing_written(run, 0)


@pytest.fixture()
def poisoned_policy(tmp_path, policy_dir) -> Path:
    """One nan in a query projection: on CPU its forward pass stays finite (only the gradient is nan),
    so only the parameter check can tell this checkpoint is broken."""
    model, tokenizer = load_policy(policy_dir)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = math.nan
    return save_policy(model, tokenizer, tmp_path / "poisoned")


def test_poisoned_weights_never_reach_a_new_checkpoint(tmp_path, poisoned_policy):
    run = _run_with_tables(tmp_path)
    # a single skipped update is tolerated, but the weights it leaves are not savable
    with pytest.raises(NonFiniteTrainingError, match=r"non-finite parameters after training "
                                                     r"\(model\.layers\.1\.self_attn\.q_proj\.weight\)"):
        _train(run, poisoned_policy)
    assert _nothing_written(run, 0)
    with pytest.raises(NonFiniteTrainingError, match="4 of 4 updates were skipped"):
        _train(run, poisoned_policy, epochs=4)
    assert _nothing_written(run, 0)


def test_the_run_of_skips_continues_from_the_previous_iteration(tmp_path, poisoned_policy):
    run = _run_with_tables(tmp_path, iteration=1)
    reason = "non-finite log-probs from the model on 9 of 9 tokens (its weights or activations overflowed)"
    previous = [{"run_id": "r1", "iteration": 0, "update_idx": i, **vars(_result(reason)), "started_at": 0.0, "finished_at": 1.0} for i in range(3)]
    previous[0] = {**previous[0], **vars(_result(None))}
    write_table("train_metrics", previous, run.table_uri(0, "train_metrics"))
    with pytest.raises(NonFiniteTrainingError, match="iteration 1: 1 of 1 updates.*after 2 at the end of the "
                                                     "previous iteration.*3 in a row"):
        _train(run, poisoned_policy, iteration=1, max_consecutive_nonfinite=2)
    assert _nothing_written(run, 1)
