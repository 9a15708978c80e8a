"""GiGPO: hand-worked values, a plain reference from the paper's equations on random batches,
invariances, and the anchor's way from the env through the agent loop and the steps table."""

from __future__ import annotations

import json
import math
import random
import statistics
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from agent_core.algos.estimator_core import AdvantageInputs, GroupOfOneWarning, estimate_advantages
from agent_core.algos.step_advantages import StepRewardRow, anchor_grid, estimate_step_advantages, prepare_episodes
from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.envs.tool_env import observation_anchor
from agent_core.envs.tools import ToolCallOutcome
from agent_core.io.tables import read_table
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.training.model import build_tokenizer
from schemas import table_from_rows

# ---------------------------------------------------------------- a small multi-turn batch
# Group p (3 episodes), group q (2). Each step: (tokens, reward, anchor of the state it started from).
#   a: S(0) -> X(0) -> Y(1)   score 1      returns (gamma 0.5): 0.25, 0.5, 1
#   b: S(0) -> X(1)           score 1      returns 0.5, 1
#   c: S(0) -> Z(0)           score 0      returns 0, 0
#   d: T(0) -> X(0.5)         score 0.5    returns 0.25, 0.5   (X again, but in group q: not pooled with p's X)
#   e: T(0.2) -> W(0)         score 0.2    returns 0.2, 0
BATCH = {
    ("p", "a"): [(2, 0.0, "S"), (1, 0.0, "X"), (3, 1.0, "Y")],
    ("p", "b"): [(1, 0.0, "S"), (2, 1.0, "X")],
    ("p", "c"): [(2, 0.0, "S"), (2, 0.0, "Z")],
    ("q", "d"): [(1, 0.0, "T"), (1, 0.5, "X")],
    ("q", "e"): [(3, 0.2, "T"), (1, 0.0, "W")],
}
STEPS = {episode: steps for (_, episode), steps in BATCH.items()}


def rows_of(batch):
    """StepRewardRows, contexts not append-only (the grid holds the responses only)."""
    return [StepRewardRow(episode, group, k, [1], [5] * n, reward, anchor)
            for (group, episode), steps in batch.items() for k, (n, reward, anchor) in enumerate(steps)]


def per_step(results):
    """{(episode, step): the step's token advantages} from StepAdvantage records."""
    return {(r.episode_id, r.step_idx): r for r in results}


def run(batch, estimator="gigpo", gamma=0.5, norm_by_std=True, omega=1.0, eps=0.0):
    return per_step(estimate_step_advantages(
        prepare_episodes(rows_of(batch)), estimator=estimator, gamma=gamma, lam=1.0, eps=eps,
        norm_by_std=norm_by_std, use_advantage_mask=True, omega=omega))


def test_hand_worked_values_with_std():
    out = run(BATCH)
    # episode level, group p: scores 1, 1, 0: mean 2/3, unbiased std 1/sqrt(3) -> +1/sqrt3, +1/sqrt3, -2/sqrt3
    # group q: scores 0.5, 0.2: mean 0.35, std 0.15*sqrt(2) -> +1/sqrt2, -1/sqrt2
    ep_a, ep_c, ep_d = 1 / math.sqrt(3), -2 / math.sqrt(3), 1 / math.sqrt(2)
    # anchor S: returns 0.25, 0.5, 0 -> mean 0.25, std 0.25 -> 0, +1, -1
    # anchor X in p: returns 0.5 (a), 1 (b) -> mean 0.75, std 0.25*sqrt(2) -> -1/sqrt2, +1/sqrt2
    # anchor T in q: returns 0.25 (d), 0.2 (e) -> +1/sqrt2, -1/sqrt2; Y, Z, W and q's X are singletons -> 0
    s = 1 / math.sqrt(2)
    expected = {
        ("a", 0): ep_a + 0.0, ("a", 1): ep_a - s, ("a", 2): ep_a,
        ("b", 0): ep_a + 1.0, ("b", 1): ep_a + s,
        ("c", 0): ep_c - 1.0, ("c", 1): ep_c,
        ("d", 0): ep_d + s, ("d", 1): ep_d,
        ("e", 0): -ep_d - s, ("e", 1): -ep_d,
    }
    returns = {("a", 0): 0.25, ("a", 1): 0.5, ("a", 2): 1.0, ("b", 0): 0.5, ("b", 1): 1.0, ("c", 0): 0.0,
               ("c", 1): 0.0, ("d", 0): 0.25, ("d", 1): 0.5, ("e", 0): 0.2, ("e", 1): 0.0}
    for (episode, k), value in expected.items():
        n = STEPS[episode][k][0]
        assert out[episode, k].advantages == pytest.approx([value] * n, abs=1e-5), (episode, k)
        assert out[episode, k].returns == pytest.approx([returns[episode, k]] * n, abs=1e-6), (episode, k)


def test_hand_worked_values_without_std():
    out = run(BATCH, norm_by_std=False, omega=2.0)
    # episode: p centred 1/3, 1/3, -2/3; q 0.15, -0.15. steps: S 0, +0.25, -0.25; X(p) -0.25, +0.25; T +-0.025
    expected = {("a", 0): 1 / 3, ("a", 1): 1 / 3 - 0.5, ("a", 2): 1 / 3, ("b", 0): 1 / 3 + 0.5, ("b", 1): 1 / 3 + 0.5,
                ("c", 0): -2 / 3 - 0.5, ("c", 1): -2 / 3, ("d", 0): 0.15 + 0.05, ("d", 1): 0.15,
                ("e", 0): -0.15 - 0.05, ("e", 1): -0.15}
    for (episode, k), value in expected.items():
        assert out[episode, k].advantages[0] == pytest.approx(value, abs=1e-6), (episode, k)


def test_gigpo_credits_steps_of_one_episode_differently_where_grpo_cannot():
    """Fails for grpo: it gives every step of an episode the same value (a's steps 0 and 1 differ here)."""
    gigpo, grpo = run(BATCH), run(BATCH, estimator="grpo")
    assert gigpo["a", 1].advantages[0] < gigpo["a", 0].advantages[0] - 0.5
    assert grpo["a", 1].advantages[0] == pytest.approx(grpo["a", 0].advantages[0])
    assert gigpo["b", 0].advantages[0] - grpo["b", 0].advantages[0] == pytest.approx(1.0, abs=1e-5)


def test_anchor_ids_stay_within_their_prompt_group():
    # q's X pooled with p's X would give d's step 1 a step advantage; it must stay a singleton (0)
    out = run(BATCH, norm_by_std=False)
    assert out["d", 1].advantages[0] == pytest.approx(0.15, abs=1e-6)


# ------------------------------------------------ reference from the paper's equations, random batches

def reference(batch, gamma, norm_by_std, omega, eps):
    """Plain loops: A^E over each group's episodes (Eq. 3), discounted step returns (Eq. 5), anchor
    groups of (group, anchor) (Eq. 6), A^S within them (Eq. 7), A = A^E + omega * A^S (Eq. 8)."""
    def normalise(value, values):
        if len(values) < 2:
            return 0.0
        centred = value - statistics.mean(values)
        return centred / (statistics.stdev(values) + eps) if norm_by_std else centred

    scores = {key: sum(r for _, r, _ in steps) for key, steps in batch.items()}
    returns = {}
    for key, steps in batch.items():
        following = 0.0
        for k in reversed(range(len(steps))):
            following = steps[k][1] + gamma * following
            returns[key, k] = following
    anchor_groups: dict[tuple, list[float]] = {}
    for (group, episode), steps in batch.items():
        for k, (_, _, anchor) in enumerate(steps):
            if anchor is not None:
                anchor_groups.setdefault((group, anchor), []).append(returns[(group, episode), k])
    out = {}
    for (group, episode), steps in batch.items():
        group_scores = [s for (g, _), s in scores.items() if g == group]
        episode_adv = normalise(scores[group, episode], group_scores)
        for k, (_, _, anchor) in enumerate(steps):
            step_adv = 0.0 if anchor is None else normalise(returns[(group, episode), k], anchor_groups[group, anchor])
            out[episode, k] = (episode_adv + omega * step_adv, returns[(group, episode), k])
    return out


def random_batch(rng: random.Random):
    batch = {}
    for g in range(rng.randint(1, 3)):
        for e in range(rng.randint(1, 4)):
            steps = []
            for _ in range(rng.randint(1, 4)):
                reward = rng.choice([0.0, 1.0, round(rng.uniform(-1, 1), 3)])
                steps.append((rng.randint(1, 3), reward, rng.choice(["A", "B", "C", None])))
            batch[f"g{g}", f"g{g}e{e}"] = steps
    return batch


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_reference_on_random_batches(seed):
    rng = random.Random(seed)
    batch = random_batch(rng)
    gamma, norm_by_std, omega = rng.choice([1.0, 0.9, 0.5]), rng.random() < 0.5, rng.choice([0.0, 0.5, 1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GroupOfOneWarning)
        out = run(batch, gamma=gamma, norm_by_std=norm_by_std, omega=omega, eps=1e-6)
    for (episode, k), (advantage, step_return) in reference(batch, gamma, norm_by_std, omega, 1e-6).items():
        record = out[episode, k]
        assert record.advantages == pytest.approx([advantage] * len(record.advantages), abs=1e-4, rel=1e-4)
        assert record.returns == pytest.approx([step_return] * len(record.returns), abs=1e-5)


# ---------------------------------------------------------------- invariances

def _grid_inputs(batch, **kwargs):
    prepared = prepare_episodes(rows_of(batch))
    layout = prepared.layout
    return AdvantageInputs(layout.token_rewards, layout.action_mask, prepared.group_index,
                           step_starts=layout.step_starts, step_anchors=anchor_grid(prepared), **kwargs)


@pytest.mark.parametrize("seed", range(10))
def test_omega_zero_equals_grpo_exactly(seed):
    batch = random_batch(random.Random(100 + seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GroupOfOneWarning)
        for norm_by_std in (True, False):
            inputs = _grid_inputs(batch, omega=0.0, gamma=0.9, norm_by_std=norm_by_std)
            assert torch.equal(estimate_advantages("gigpo", inputs).advantages,
                               estimate_advantages("grpo", inputs).advantages)


def test_unique_anchors_get_zero_step_advantage():
    unique = {key: [(n, r, f"{key[1]}-{k}") for k, (n, r, _) in enumerate(steps)] for key, steps in BATCH.items()}
    unanchored = {key: [(n, r, None) for n, r, _ in steps] for key, steps in BATCH.items()}
    grpo = _grid_inputs(BATCH, omega=5.0, gamma=0.5)
    expected = estimate_advantages("grpo", grpo).advantages
    for batch in (unique, unanchored):
        assert torch.equal(estimate_advantages("gigpo", _grid_inputs(batch, omega=5.0, gamma=0.5)).advantages, expected)


def test_a_group_with_equal_returns_gets_zero_episode_advantage():
    # every episode scores 1; shared anchors S and X still differ in their discounted returns
    equal = {("p", "a"): [(2, 0.0, "S"), (1, 1.0, "X")], ("p", "b"): [(1, 1.0, "S")],
             ("p", "c"): [(1, 0.0, "S"), (2, 0.0, "X"), (1, 1.0, "V")]}
    one = estimate_advantages("gigpo", _grid_inputs(equal, omega=1.0, gamma=0.5)).advantages
    two = estimate_advantages("gigpo", _grid_inputs(equal, omega=2.0, gamma=0.5)).advantages
    assert torch.allclose(two, 2 * one, atol=1e-6)  # A^E = 0: all that is left scales with omega
    assert torch.count_nonzero(one) > 0
    assert torch.count_nonzero(estimate_advantages("gigpo", _grid_inputs(equal, omega=0.0)).advantages) == 0


def test_inputs_are_checked():
    inputs = _grid_inputs(BATCH)
    with pytest.raises(ValueError, match="step_anchors shape"):
        AdvantageInputs(inputs.token_rewards, inputs.mask, inputs.group_index, step_anchors=torch.zeros(2, 2,
                        dtype=torch.long))
    with pytest.raises(ValueError, match="step_anchors must be an integer"):
        AdvantageInputs(inputs.token_rewards, inputs.mask, inputs.group_index,
                        step_anchors=inputs.step_anchors.to(torch.float32))
    with pytest.raises(ValueError, match="needs step_anchors"):
        estimate_advantages("gigpo", AdvantageInputs(inputs.token_rewards, inputs.mask, inputs.group_index,
                                                     step_starts=inputs.step_starts))
    with pytest.raises(ValueError, match="needs step_starts"):
        estimate_advantages("gigpo", AdvantageInputs(inputs.token_rewards, inputs.mask, inputs.group_index,
                                                     step_anchors=inputs.step_anchors))


def test_observation_tokens_carry_their_steps_advantage_with_the_loss_mask_off():
    # append-only: step 1's context extends step 0's context + response + observation [90, 91]
    rows = [StepRewardRow("a", "g", 0, [1], [10, 11], 0.0, "S"), StepRewardRow("a", "g", 1, [1, 10, 11, 90, 91], [12], 1.0, "X"),
            StepRewardRow("b", "g", 0, [1], [20], 0.0, "S"), StepRewardRow("b", "g", 1, [1, 20, 92], [21], 0.0, "X")]
    results = per_step(estimate_step_advantages(prepare_episodes(rows), estimator="gigpo", gamma=1.0, lam=1.0, eps=0.0,
                                                norm_by_std=False, use_advantage_mask=True, use_loss_mask=False))
    # scores 1, 0 -> A^E +-0.5; S: returns 1, 0 -> +-0.5; X: 1, 0 -> +-0.5
    assert results["a", 0].advantages == pytest.approx([1.0, 1.0]) and results["a", 0].obs_advantages == pytest.approx([1.0, 1.0])
    assert results["b", 1].advantages == pytest.approx([-1.0])


# ---------------------------------------------------------------- the anchor from env to table

@pytest.fixture(scope="module")
def task():
    dataset = generate_synthetic_qa(seed=3, num_films=12, num_people=10, num_cities=5, num_countries=3)
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    return dataset, build_tokenizer(texts, vocab_size=400), EnvResources(search_index=Bm25Index(dataset.documents))


def test_search_env_anchor_is_the_set_of_retrieved_documents(task):
    dataset, _, resources = task
    env = make_env("search_qa", {}, resources)
    title = dataset.documents[0].title
    first = env.step(f"<search>{title}</search>")
    assert first.anchor == "docs:" + ",".join(sorted(first.info["doc_ids"]))
    assert env.step(f"<search>{title.upper()} the</search>").anchor == first.anchor  # another query, same documents
    ranked = [ToolCallOutcome("search", {}, True, text, 0.0, None, 0.0, {"doc_ids": ids})
              for text, ids in (("d1 then d2", ["d1", "d2"]), ("d2 then d1", ["d2", "d1"]))]
    assert observation_anchor(ranked[:1], []) == observation_anchor(ranked[1:], []) == "docs:d1,d2"
    calculator = [ToolCallOutcome("calculator", {}, True, text, 0.0, None, 0.0) for text in ("4", " 4 \n", "5")]
    keys = [observation_anchor([outcome], []) for outcome in calculator]
    assert keys[0] == keys[1] != keys[2] and keys[0].startswith("calculator:")
    assert env.step("<search>zzzz qqqq</search>").anchor == "docs:"
    assert env.step("no call at all").anchor.startswith("invalid:")
    assert env.step("<answer>x</answer>").anchor is None


class _Engine:
    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.turn = tokenizer, script, 0

    def generate(self, prompts, params):
        ids = self.tokenizer.encode(self.script[min(self.turn, len(self.script) - 1)], add_special_tokens=False)
        self.turn += 1
        return [Generation(ids + [self.tokenizer.eos_token_id], [-1.0] * (len(ids) + 1), "stop") for _ in prompts]


def test_the_loop_records_the_anchor_of_the_state_each_step_starts_from(task):
    dataset, tokenizer, resources = task
    title = dataset.documents[0].title
    engine = _Engine(tokenizer, [f"<search>{title}</search>", "<search>zzzz</search>", "<answer>x</answer>"])
    settings = LoopSettings(group_size=2, max_steps=4, max_context_tokens=2048, policy_version=0)
    steps = run_episodes(engine, tokenizer, dataset.prompts[:2], lambda p: make_env(p.env_name, p.env_kwargs, resources),
                         SamplingParams(max_new_tokens=16, stop_token_ids=eos_token_ids(tokenizer)), settings)
    by_step = {(s.episode_id, s.step_idx): s for s in steps}
    firsts = [s for s in steps if s.step_idx == 0]
    assert all(s.anchor.startswith("start:") for s in firsts)
    for a in firsts:  # the opening state is shared exactly by the episodes of one prompt
        assert all((a.anchor == b.anchor) == (a.group_id == b.group_id) for b in firsts)
    for s in steps:
        if s.step_idx > 0:
            before = by_step[s.episode_id, s.step_idx - 1]
            assert s.anchor == "docs:" + ",".join(sorted(json.loads(before.info).get("doc_ids", [])))


def test_a_steps_table_written_before_the_anchor_column_reads_as_null(tmp_path):
    row = {"run_id": "r", "iteration": 0, "episode_id": "e", "group_id": "g", "prompt_id": "q", "sample_idx": 0,
           "step_idx": 0, "policy_version": 0, "prompt_ids": [1], "response_ids": [2], "response_logprobs": [-0.5],
           "response_text": "x", "tool_calls": "[]", "parse_error": None, "observation_text": "", "env_reward": 0.0,
           "done": True, "termination": "answered", "truncated": False, "finish_reason": "stop", "prefix_shared": False,
           "info": "{}", "served_by": None, "retries": 0, "generated_at": 1.0}
    old = table_from_rows("steps", [row]).drop_columns(["anchor"])
    path = tmp_path / "steps.parquet"
    pq.write_table(pa.Table.from_arrays(old.columns, names=old.column_names), path)
    assert read_table("steps", path).column("anchor").to_pylist() == [None]


def test_observation_rewards_matter_only_with_the_advantage_mask_off():
    # append-only episodes with tool output [90, 91] / [92] between their two actions
    rows = [StepRewardRow("a", "g", 0, [1], [10, 11], 0.0, "S"), StepRewardRow("a", "g", 1, [1, 10, 11, 90, 91], [12], 1.0, "X"),
            StepRewardRow("b", "g", 0, [1], [20], 0.0, "S"), StepRewardRow("b", "g", 1, [1, 20, 92], [21], 0.0, "X")]
    prepared = prepare_episodes(rows)
    layout = prepared.layout
    observation = (layout.real_mask == 1) & (layout.action_mask == 0)
    noise = torch.where(observation, torch.linspace(-1.0, 2.0, observation.numel()).reshape(observation.shape), 0.0)

    def advantages(mask, perturb):
        return estimate_advantages("gigpo", AdvantageInputs(
            layout.token_rewards + perturb * noise, mask, prepared.group_index, step_starts=layout.step_starts,
            step_anchors=anchor_grid(prepared), gamma=0.9, norm_by_std=False)).advantages[layout.action_mask == 1]

    assert torch.equal(advantages(layout.action_mask, 0.0), advantages(layout.action_mask, 1.0))
    assert not torch.allclose(advantages(layout.real_mask, 0.0), advantages(layout.real_mask, 1.0), atol=1e-4)
