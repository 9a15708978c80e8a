"""The shipped mask ablations (configs/algos/*) change the trained signal, through the pipeline's
own code path: config -> advantages stage settings (tasks.compute_advantages.estimator_settings)
-> estimate_step_advantages -> training rows -> train_iteration with the train stage's settings
(PPOSettings.from_config). A no-op ablation (same action-token advantages and gradients
as its base, or gradients only rescaled) fails these tests.

Two batches: one fixed multi-turn batch (two groups, observation tokens between actions, a tiny
Llama) for "differs / equal" checks, and a two-episode batch small enough to work out by hand
(a bigram model whose parameters are its logits) for the direction of each change.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_core.algos.estimator_core import estimator_uses_critic
from agent_core.algos.step_advantages import StepRewardRow, estimate_step_advantages, prepare_episodes
from agent_core.config import ConfigError
from agent_core.training.batches import TrainStep, choose_layout
from agent_core.training.scoring import score_logprobs
from agent_core.training.settings import PPOSettings
from agent_core.training.trainer import train_iteration
from agent_core.validation import load_config
from tasks.compute_advantages import estimator_settings

ALGOS = Path(__file__).resolve().parent.parent / "configs" / "algos"
# ablation -> the config it ablates (the paper's chain: ppo -> no advantage mask -> no masks)
ABLATIONS = {"ppo_no_advantage_mask": "ppo", "ppo_no_masks": "ppo_no_advantage_mask", "grpo_no_loss_mask": "grpo"}
PAD = 0


def config(name: str, *overrides: str):
    return load_config([ALGOS / f"{name}.yaml"], list(overrides))


def test_every_shipped_ablation_is_covered_here():
    ablations = {p.stem for p in ALGOS.glob("*.yaml")
                 if not (config(p.stem).algorithm.use_loss_mask and config(p.stem).algorithm.use_advantage_mask)}
    assert ablations == set(ABLATIONS)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_an_advantage_mask_ablation_that_cannot_change_anything_is_refused(estimator):
    with pytest.raises(ConfigError, match=f"use_advantage_mask=false changes nothing for estimator '{estimator}'"):
        config("grpo", f"algorithm.estimator={estimator}", "algorithm.use_advantage_mask=false")
    assert not config("reinforce_pp", "algorithm.use_advantage_mask=false").algorithm.use_advantage_mask


def episode(name, group, first_prompt, turns, outcome, process=()):
    """StepRewardRows of an append-only episode: turns = [(response, observation after it), ...];
    each row's reward combined as labelling does under the default config (process weight 1, no
    normalizer): process + outcome."""
    rows, context = [], list(first_prompt)
    for k, (response, observation) in enumerate(turns):
        last = k == len(turns) - 1
        rows.append(StepRewardRow(name, group, k, list(context), list(response),
                                  (process[k] if k < len(process) else 0.0) + (outcome if last else 0.0)))
        context += list(response) + list(observation)
    return rows


# Fixed multi-turn batch: two groups of two; tool output between actions; process rewards.
BATCH = [
    *episode("a", "g1", [1, 2, 3], [([10, 11], [40, 41, 42]), ([12], [])], 1.0, process=(0.2,)),
    *episode("b", "g1", [1, 2, 3], [([13], [43]), ([14, 15], [])], 0.0),
    *episode("c", "g2", [4, 5], [([16, 17], [44, 45]), ([18], [46, 47]), ([19], [])], 1.0),
    *episode("d", "g2", [4, 5], [([20, 21, 22], [])], 0.0, process=(-0.1,)),
]


def fixed_values(layout):
    return torch.linspace(-0.4, 0.6, layout.token_rewards.numel()).reshape(layout.token_rewards.shape)


def advantages(cfg, rows=BATCH, values=fixed_values):
    """The advantages stage's computation (no reference model: no in-reward KL, for every config)."""
    algorithm = cfg.algorithm
    batch = prepare_episodes(rows)
    grid = values(batch.layout) if estimator_uses_critic(algorithm.estimator) else None
    return estimate_step_advantages(batch, **estimator_settings(algorithm), values=grid)


def action_advantages(results) -> torch.Tensor:
    return torch.tensor([a for r in results for a in r.advantages], dtype=torch.float64)


def action_returns(results) -> torch.Tensor:
    return torch.tensor([a for r in results for a in r.returns], dtype=torch.float64)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).float()


def training_episodes(rows, results, model) -> list[list[TrainStep]]:
    """TrainSteps as the train stage joins them; sampling and reference log-probs = the model's own
    (iteration 0: rollout policy = reference = policy), so ratios are 1 and the KL has no gradient."""
    scored = score_logprobs(model, [r.prompt_ids + r.response_ids for r in rows], PAD, 4096, 1.0)
    own = {(r.episode_id, r.step_idx): lp[len(r.prompt_ids):] for r, lp in zip(rows, scored)}
    episodes: dict[str, list[TrainStep]] = {}
    for row, result in zip(sorted(rows, key=lambda r: (r.episode_id, r.step_idx)),
                           sorted(results, key=lambda r: (r.episode_id, r.step_idx))):
        logprobs = own[row.episode_id, row.step_idx]
        episodes.setdefault(row.episode_id, []).append(TrainStep(
            row.prompt_ids, row.response_ids, logprobs, result.advantages, ref_logprobs=logprobs,
            values=result.values, returns=result.returns, obs_advantages=result.obs_advantages,
            obs_returns=result.obs_returns, obs_values=result.obs_values))
    return list(episodes.values())


def gradient(cfg, model_factory=tiny_llama, rows=BATCH, values=fixed_values) -> torch.Tensor:
    """Minus the policy gradient of one update (SGD, lr 1, no clipping), all parameters flattened."""
    model = model_factory()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    sequences = choose_layout(training_episodes(rows, advantages(cfg, rows, values), model), cfg.trainer.layout)
    settings = replace(PPOSettings.from_config(cfg.trainer, cfg.algorithm, 1.0), epochs=1, mini_batches=1,
                       max_grad_norm=None)
    [result] = train_iteration(model, torch.optim.SGD(model.parameters(), lr=1.0), sequences, settings, pad_id=PAD,
                               seed=0)
    assert not result.skipped
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(a.norm()), float(b.norm())))


def off_the_line_of(a: torch.Tensor, base: torch.Tensor) -> float:
    """How much of `a` is not a multiple of `base` (0: a = c * base, e.g. a rescaled update)."""
    projection = (a @ base) / (base @ base) * base
    return float((a - projection).norm() / a.norm())


# ----------------------------------------------------------------- each ablation vs its base

def test_ppo_without_the_advantage_mask_changes_action_advantages_not_value_targets():
    base, ablation = advantages(config("ppo")), advantages(config("ppo_no_advantage_mask"))
    assert (action_advantages(base) - action_advantages(ablation)).abs().max() > 1e-2
    # gamma = lam = 1: the value target of an action token is its return-to-go either way
    assert torch.allclose(action_returns(base), action_returns(ablation), atol=1e-6)
    assert all(r.obs_returns is not None for r in ablation if r.obs_advantages)
    assert relative_difference(gradient(config("ppo")), gradient(config("ppo_no_advantage_mask"))) > 1e-2


def test_without_whitening_the_advantage_mask_ablation_would_be_a_no_op():
    """Why ppo*.yaml whiten: unwhitened GAE at gamma = lam = 1 is G_t - V_t over any tokens."""
    raw = "algorithm.whiten_advantages=false"
    base, ablation = advantages(config("ppo", raw)), advantages(config("ppo_no_advantage_mask", raw))
    assert torch.allclose(action_advantages(base), action_advantages(ablation), atol=1e-6)


def test_ppo_without_both_masks_keeps_action_advantages_and_changes_the_update():
    base_cfg, cfg = config("ppo_no_advantage_mask"), config("ppo_no_masks")
    base, ablation = advantages(base_cfg), advantages(cfg)
    assert torch.equal(action_advantages(base), action_advantages(ablation))  # the loss mask is no estimator input
    base_gradient, ablation_gradient = gradient(base_cfg), gradient(cfg)
    assert relative_difference(base_gradient, ablation_gradient) > 1e-2
    assert off_the_line_of(ablation_gradient, base_gradient) > 1e-2  # not just a rescaled update
    assert relative_difference(gradient(config("ppo")), ablation_gradient) > 1e-2


def test_grpo_without_the_loss_mask_keeps_action_advantages_and_trains_observations():
    base_cfg, cfg = config("grpo"), config("grpo_no_loss_mask")
    base, ablation = advantages(base_cfg), advantages(cfg)
    assert torch.equal(action_advantages(base), action_advantages(ablation))
    for result in ablation:  # observation tokens carry their episode's advantage
        if result.obs_advantages:
            assert result.obs_advantages == pytest.approx([result.advantages[-1]] * len(result.obs_advantages))
    assert any(a != 0 for r in ablation for a in (r.obs_advantages or []))
    base_gradient, ablation_gradient = gradient(base_cfg), gradient(cfg)
    # the old no-op zeroed observation advantages: the update was the base's times n_action / n_all
    assert off_the_line_of(ablation_gradient, base_gradient) > 1e-2


def test_packed_and_step_rows_train_the_same_tokens_with_masks_off():
    cfg = config("ppo_no_masks")
    packed = gradient(cfg)
    rows = gradient(config("ppo_no_masks", "trainer.layout=step"))
    assert relative_difference(packed, rows) < 1e-4


# ------------------------------------------------------------------ directions, by hand

class Bigram(torch.nn.Module):
    """logits after token i = table[i]: the log-prob of token t is a function of table[prev, :] only."""

    def __init__(self, vocab: int = 100):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))
        self.config = SimpleNamespace(vocab_size=vocab)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids])


V = 100
# A: [1, 2] | act 10 | obs 90 91 | act 11, outcome 1.   B: [3, 4] | act 12, outcome 0.   One group.
# Every token follows a different token, so each table row gets one token's gradient:
# SGD (lr 1) moves table[prev, token] by A_token / n * (1 - 1/V) at a uniform start (ratio 1).
HAND = [*episode("A", "g", [1, 2], [([10], [90, 91]), ([11], [])], 1.0), *episode("B", "g", [3, 4], [([12], [])], 0.0)]


def zero_values(layout):
    return torch.zeros(layout.token_rewards.shape)


def hand_delta(name: str) -> dict[str, float]:
    delta = gradient(config(name), model_factory=lambda: Bigram(V), rows=HAND, values=zero_values).reshape(V, V)
    return {"act 10": float(delta[2, 10]), "obs 90": float(delta[10, 90]), "obs 91": float(delta[90, 91]),
            "act 11": float(delta[91, 11]), "act 12": float(delta[4, 12])}


def test_direction_advantage_mask_off_whitening_counts_the_tool_output():
    # values 0, gamma = lam = 1: raw GAE = 1 on A's tokens, 0 on B's.
    # mask on: whitened over [1, 1, 0] (mean 2/3, unbiased std 1/sqrt 3): A 1/sqrt 3, B -2/sqrt 3
    # mask off: over [1, 1, 1, 1, 0] (A's tool output too; mean 4/5, std 1/sqrt 5): A 1/sqrt 5, B -4/sqrt 5
    on = {(r.episode_id, r.step_idx): r for r in advantages(config("ppo"), HAND, zero_values)}
    off = {(r.episode_id, r.step_idx): r for r in advantages(config("ppo_no_advantage_mask"), HAND, zero_values)}
    assert on["A", 0].advantages == pytest.approx([1 / math.sqrt(3)], abs=1e-5)
    assert on["B", 0].advantages == pytest.approx([-2 / math.sqrt(3)], abs=1e-5)
    assert off["A", 0].advantages == pytest.approx([1 / math.sqrt(5)], abs=1e-5)
    assert off["B", 0].advantages == pytest.approx([-4 / math.sqrt(5)], abs=1e-5)
    assert off["A", 0].obs_advantages == pytest.approx([1 / math.sqrt(5)] * 2, abs=1e-5)
    # so the rewarded, tool-using episode is pushed up less and the short failed one down more
    assert off["A", 0].advantages[0] < on["A", 0].advantages[0]
    assert off["B", 0].advantages[0] < on["B", 0].advantages[0]


def test_direction_loss_mask_off_in_ppo_trains_tool_output_of_the_rewarded_episode():
    scale = 1 - 1 / V
    a, b = 1 / math.sqrt(5), -4 / math.sqrt(5)  # whitened with the advantage mask off (test above)
    # loss mask on: 3 action tokens; off: 5 tokens after the first prompts (A's tool output too)
    assert hand_delta("ppo_no_advantage_mask") == pytest.approx(
        {"act 10": a / 3 * scale, "obs 90": 0.0, "obs 91": 0.0, "act 11": a / 3 * scale, "act 12": b / 3 * scale},
        rel=1e-5, abs=1e-6)
    assert hand_delta("ppo_no_masks") == pytest.approx(
        {"act 10": a / 5 * scale, "obs 90": a / 5 * scale, "obs 91": a / 5 * scale, "act 11": a / 5 * scale,
         "act 12": b / 5 * scale}, rel=1e-5, abs=1e-6)


def test_direction_loss_mask_off_in_grpo_trains_tool_output_with_the_episode_advantage():
    scale = 1 - 1 / V
    a, b = 1 / math.sqrt(2), -1 / math.sqrt(2)  # scores 1, 0: mean 1/2, unbiased std 1/sqrt 2
    assert hand_delta("grpo") == pytest.approx(
        {"act 10": a / 3 * scale, "obs 90": 0.0, "obs 91": 0.0, "act 11": a / 3 * scale, "act 12": b / 3 * scale},
        rel=1e-5, abs=1e-6)
    # the tool output of the rewarded episode is now pushed up with A's advantage (the no-op gave 0)
    assert hand_delta("grpo_no_loss_mask") == pytest.approx(
        {"act 10": a / 5 * scale, "obs 90": a / 5 * scale, "obs 91": a / 5 * scale, "act 11": a / 5 * scale,
         "act 12": b / 5 * scale}, rel=1e-5, abs=1e-6)
