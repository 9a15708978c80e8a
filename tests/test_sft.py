"""Warm start: supervised fine-tuning on action tokens only, and SQL selection of episodes."""

from __future__ import annotations

import logging

import pytest
import torch

from agent_core.io.query import QueryError, select_episode_ids
from agent_core.io.tables import write_table
from agent_core.training.batches import TrainStep, choose_layout
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.scoring import sequence_logprobs
from agent_core.training.sft import sft_step, sft_train
from agent_core.training.trainer import make_optimizer
from test_schemas import rewards_rows, steps_rows

TEXTS = ["question: where was tessa born", "<search>tessa</search>", "<answer>quillport</answer>", "result"] * 4


@pytest.fixture()
def setup():
    tokenizer = build_tokenizer(TEXTS, vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = enc("question: where was tessa born")
    action1, observation, action2 = enc("<search>tessa</search>"), enc("result"), enc("<answer>quillport</answer>")
    steps = [TrainStep(prompt, action1, [0.0] * len(action1), [0.0] * len(action1)),
             TrainStep(prompt + action1 + observation, action2, [0.0] * len(action2), [0.0] * len(action2))]
    return tokenizer, model, steps


def test_nll_is_the_mean_over_action_tokens_only(setup):
    tokenizer, model, steps = setup
    sequence = choose_layout([steps])[0]
    ids = torch.tensor([sequence.input_ids])
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids))
    action = torch.tensor(sequence.action_mask, dtype=torch.bool)
    expected = -logprobs[0][action].mean().item()
    result = sft_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [sequence], pad_id=tokenizer.pad_token_id,
                      micro_batch_tokens=64, max_grad_norm=None)
    assert result.nll == pytest.approx(expected, rel=1e-5) and result.tokens == int(action.sum())


def test_all_tokens_is_the_mean_over_every_predicted_token(setup):
    tokenizer, model, steps = setup
    sequence = choose_layout([steps])[0]
    ids = torch.tensor([sequence.input_ids])
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids))
    expected = -logprobs[0][1:].mean().item()  # the first token has no context: never a target
    result = sft_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [sequence], pad_id=tokenizer.pad_token_id,
                      micro_batch_tokens=64, max_grad_norm=None, all_tokens=True)
    assert result.nll == pytest.approx(expected, rel=1e-5) and result.tokens == len(sequence) - 1


def test_sft_learns_the_actions_and_greedy_decoding_reproduces_them(setup):
    tokenizer, model, steps = setup
    sequences = choose_layout([steps])
    results = sft_train(model, make_optimizer(model, lr=3e-3), sequences, pad_id=tokenizer.pad_token_id, epochs=60,
                        batch_size=1, micro_batch_tokens=256)
    assert results[-1].nll < 0.1 * results[0].nll and not any(r.skipped for r in results)
    model.eval()
    prompt = torch.tensor([steps[0].prompt_ids])
    out = model.generate(prompt, max_new_tokens=len(steps[0].response_ids), do_sample=False)
    assert out[0, prompt.shape[1]:].tolist() == steps[0].response_ids


def test_progress_is_logged_every_log_every_steps_with_the_total(setup, caplog):
    """A slow machine's warm start (minutes a step) says where it is, not only at each epoch's end."""
    tokenizer, model, steps = setup
    sequences = choose_layout([steps]) * 3  # 3 sequences, batches of 2: 2 steps an epoch, 6 in all
    log = logging.getLogger("sft-progress-test")
    with caplog.at_level(logging.INFO, logger=log.name):
        results = sft_train(model, make_optimizer(model, lr=1e-3), sequences, pad_id=tokenizer.pad_token_id,
                            epochs=3, batch_size=2, micro_batch_tokens=256, log_every=2, log=log)
    assert len(results) == 6
    assert [r.getMessage().split(", NLL")[0] for r in caplog.records] == [
        f"warm start: epoch {epoch}, step {step} of 6" for epoch, step in ((0, 2), (1, 4), (2, 6))]


def _grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_observation_tokens_are_never_targets(setup):
    """The SFT gradient is exactly that of the action-token NLL, not of every position's NLL."""
    tokenizer, model, steps = setup
    sequence = choose_layout([steps])[0]
    ids = torch.tensor([sequence.input_ids])
    action = torch.tensor([sequence.action_mask], dtype=torch.float32)
    observed = (1 - action)[0, 1:].sum().item()
    assert observed > 0  # the packed episode has prompt and observation positions
    grads = {}
    for name, weights in (("action", action), ("all", torch.ones_like(action))):
        model.zero_grad()
        logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids))
        (-(logprobs * weights).sum() / weights[0, 1:].sum()).backward()
        grads[name] = _grad(model).clone()
    trainable = [p for p in model.parameters() if p.grad is not None]
    before = torch.cat([p.detach().flatten() for p in trainable]).clone()
    sft_step(model, torch.optim.SGD(trainable, lr=1.0), [sequence], pad_id=tokenizer.pad_token_id,
             micro_batch_tokens=64, max_grad_norm=None)
    step_taken = before - torch.cat([p.detach().flatten() for p in trainable])  # = lr * the SFT gradient
    assert torch.allclose(step_taken, grads["action"], atol=1e-5)
    assert not torch.allclose(step_taken, grads["all"], atol=1e-4)


def test_select_episode_ids_by_sql(tmp_path):
    steps = write_table("steps", steps_rows(), tmp_path / "steps.parquet")
    rows = rewards_rows()
    for row in rows:
        if row["episode_id"] == "ep-1" and row["step_idx"] == 2:
            row.update(em=0.0, outcome_reward=0.0, reward=-0.1)
    rewards = write_table("rewards", rows, tmp_path / "rewards.parquet")
    tables = {"steps": steps, "rewards": rewards}
    assert select_episode_ids("select episode_id from rewards where em = 1", tables) == ["ep-0"]
    assert sorted(select_episode_ids("select distinct episode_id from steps", tables)) == ["ep-0", "ep-1"]
    with pytest.raises(QueryError, match="episode_id"):
        select_episode_ids("select step_idx from steps", tables)
    with pytest.raises(QueryError):
        select_episode_ids("select episode_id from nope", tables)
