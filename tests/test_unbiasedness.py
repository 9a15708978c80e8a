"""Unbiasedness, tested: no estimator may turn the expected advantage against the better choice.

The MDP (tests/synthetic_mdp.py): from the start state the policy ANSWERs at once (one step,
right with p = 0.3) or calls a TOOL and then answers (2 + k steps, right with p = 0.7), each step
earning a process reward c and a right answer 1. Worked by hand: V_TOOL = 0.7 + (2 + k) c,
V_ANSWER = 0.3 + c. For a policy taking TOOL with probability q, the expected policy gradient on
the choice is q (1 - q) (E[A_0 | TOOL] - E[A_0 | ANSWER]) (A_0: the advantage at the first action
token, where the choice is made), so that GAP must have the sign of V_TOOL - V_ANSWER. Every
expectation is an exact sum over the compositions of a group of G episodes (no sampling).

Every registered estimator (the registry is read at collection, so a new one is covered as it
lands) is run on the token grid (actions of 3-4 tokens, tool output between them, the advantage
mask on the actions), critics with the MDP's exact value function, gigpo with the env's anchor
states, under process rewards c = +0.1, -0.1, -0.3 and k = 1..3 extra no-op tool steps (each
keeps TOOL the better choice), for q in {0.2, 0.5, 0.8} and G in {2, 4}; each composition of a
group is its own batch (batch whitening sees one group: the harshest case). A flip is allowed only
where KNOWN_FLIPS documents it, at its measured value; estimators unbiased by construction must
give the closed-form gap; a longer episode may move the gap only through a documented whitening
drift (docs/results.md, "Unbiasedness").

Teeth: the same check run on a per-turn-index normalisation (the MT-GRPO construction that
verl-project/verl#7244 shows is biased by episode length), on a per-step reward with no
return-to-go, and on a length-normalised score fails, each where it should.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch

from agent_core.algos.episodes import advantage_mask
from agent_core.algos.estimator_core import (
    ADVANTAGE_ESTIMATORS, AdvantageEstimator, AdvantageInputs, AdvantageOutput, estimator_uses_critic,
)
from synthetic_mdp import GroupBatch, ToolMDP, expected_first_advantages, group_batches

QS = (0.2, 0.5, 0.8)
GROUP_SIZES = (2, 4)
# Each keeps TOOL the better choice: V_TOOL - V_ANSWER = 0.4 + (1 + k) c > 0.
CONDITIONS = {
    "base": ToolMDP(),
    "c=+0.1": ToolMDP(step_reward=0.1),
    "c=-0.1": ToolMDP(step_reward=-0.1),
    "c=-0.3": ToolMDP(step_reward=-0.3),
    "k=1": ToolMDP(extra_tool_steps=1),
    "k=2": ToolMDP(extra_tool_steps=2),
    "k=3": ToolMDP(extra_tool_steps=3),
    "k=2,c=-0.1": ToolMDP(extra_tool_steps=2, step_reward=-0.1),
}


def true_gap(mdp: ToolMDP) -> float:
    return mdp.expected_return(True) - mdp.expected_return(False)


def cases_of(name: str) -> list[tuple[str, tuple]]:
    """(case id, options) for a registered estimator: its defaults, plus the variants it reads."""
    if estimator_uses_critic(name):
        return [(f"{name}[lam={lam},whiten={w}]", (("lam", lam), ("whiten", w))) for lam in (1.0, 0.9)
                for w in (False, True)]
    cases = [(name, ())]
    if name in ("grpo", "gigpo"):
        cases.append((f"{name}[norm_by_std=False]", (("norm_by_std", False),)))
    return cases


CASES = [case for name in ADVANTAGE_ESTIMATORS.names() for case in cases_of(name)]


def inputs_for(batch: GroupBatch, q: float, options: tuple) -> AdvantageInputs:
    """The batch on the grid with everything any estimator reads: the exact values (critics),
    step starts, and the env's anchor states (gigpo), gamma = 1."""
    layout = batch.layout
    return AdvantageInputs(
        layout.token_rewards, advantage_mask(layout, True), torch.zeros(len(batch.kinds), dtype=torch.long),
        batch.exact_values(q), step_starts=layout.step_starts, step_anchors=batch.anchor_grid(), gamma=1.0,
        **dict(options),
    )


def gaps(estimator: AdvantageEstimator, options: tuple = (), group_sizes=GROUP_SIZES) -> dict[tuple, float]:
    """(condition, q, G) -> E[A_0 | TOOL] - E[A_0 | ANSWER] of `estimator`, exact."""
    def advantages(batch: GroupBatch, q: float) -> torch.Tensor:
        return estimator(inputs_for(batch, q, options)).advantages

    return {(cond, q, size): expected_first_advantages(advantages, mdp, q, size).gap
            for cond, mdp in CONDITIONS.items() for q in QS for size in group_sizes}


@lru_cache(maxsize=None)
def registered_gaps(name: str, options: tuple) -> dict[tuple, float]:
    return gaps(ADVANTAGE_ESTIMATORS.get(name), options)


def flips(measured: dict[tuple, float]) -> dict[tuple, float]:
    """The entries whose gap does not have the sign of the true one (all true gaps are > 0)."""
    return {key: gap for key, gap in measured.items() if not gap > 1e-9}


def assert_signs_kept(measured: dict[tuple, float], known: dict[tuple, float]) -> None:
    """Every gap > 0, except exactly the documented flips, at their measured values."""
    found = flips(measured)
    assert set(found) == set(known), f"sign flips {sorted(found.items())}, documented {sorted(known)}"
    for key, value in known.items():
        assert found[key] == pytest.approx(value, abs=2e-4), key


# Measured flips, each a bias by construction (docs/results.md, "Unbiasedness"). Key:
# (condition, q, G) -> E[A_0|TOOL] - E[A_0|ANSWER]; every true gap is positive.
#
# G = 2 and a std of the pair (grpo, gigpo with norm_by_std): a pair's normalised advantages are
# +-1/sqrt(2) whatever the margin, so the estimator climbs P(beat the other episode), not the
# return. Under c < 0 a right ANSWER (1 + c) beats a right TOOL (1 + (2 + k) c) and a failed
# ANSWER beats a failed TOOL, so TOOL wins a mixed pair only when it is right and ANSWER wrong:
# P = 0.7 * 0.7 = 0.49 < 0.51, whatever q. Worked by hand: gap = (0.49 - 0.51) / sqrt(2); gigpo
# adds the same comparison again at the start-state anchor (A^E + A^S, omega = 1): twice that.
PAIR_RANK_GAP = (0.49 - 0.51) / 2 ** 0.5
NEGATIVE_C = ("c=-0.1", "c=-0.3", "k=2,c=-0.1")


def every_q(conditions, size, gap):
    return {(cond, q, size): gap for cond in conditions for q in QS}


KNOWN_FLIPS: dict[str, dict[tuple, float]] = {
    "grpo": every_q(NEGATIVE_C, 2, PAIR_RANK_GAP),
    "gigpo": every_q(NEGATIVE_C, 2, 2 * PAIR_RANK_GAP),
    # The same pair ranking, through a batch whitening of the centred scores (token-weighted, so
    # the value moves with q): measured.
    "reinforce_pp_baseline": {
        ("c=-0.1", 0.2, 2): -0.0157, ("c=-0.1", 0.5, 2): -0.0207, ("c=-0.1", 0.8, 2): -0.0257,
        ("c=-0.3", 0.2, 2): -0.0157, ("c=-0.3", 0.5, 2): -0.0207, ("c=-0.3", 0.8, 2): -0.0257,
        ("k=2,c=-0.1", 0.2, 2): -0.0156, ("k=2,c=-0.1", 0.5, 2): -0.0261, ("k=2,c=-0.1", 0.8, 2): -0.0365,
    },
    # No baseline but the batch whitening's token-weighted mean, to which an episode adds its own
    # tokens (a TOOL episode more of them): an action-dependent baseline. With a negative process
    # reward the sign flips in small batches (here the batch is one group);
    # test_reinforce_pp_bias_fades_as_the_batch_grows: 8 episodes keep it. Measured.
    "reinforce_pp": {
        ("c=-0.1", 0.2, 2): -0.2887, ("c=-0.1", 0.5, 2): -0.2806, ("c=-0.1", 0.8, 2): -0.2724,
        ("c=-0.3", 0.2, 2): -0.4105, ("c=-0.3", 0.5, 2): -0.3920, ("c=-0.3", 0.8, 2): -0.3736,
        ("k=2,c=-0.1", 0.2, 2): -0.6232, ("k=2,c=-0.1", 0.5, 2): -0.5758, ("k=2,c=-0.1", 0.8, 2): -0.5283,
        ("c=-0.3", 0.2, 4): -0.0462, ("k=2,c=-0.1", 0.2, 4): -0.1281,
    },
    # Whitening a critic's lam < 1 advantages over a batch of two episodes (the pipeline whitens
    # over the whole iteration's batch); without whitening the gap is exact (test below). Measured.
    "step_gae[lam=0.9,whiten=True]": {("c=-0.3", 0.8, 2): -0.2584, ("k=2,c=-0.1", 0.8, 2): -0.1460},
}


@pytest.mark.parametrize("case_id, options", CASES, ids=[case_id for case_id, _ in CASES])
def test_no_estimator_turns_against_the_better_choice(case_id, options):
    name = case_id.split("[")[0]
    assert_signs_kept(registered_gaps(name, options), KNOWN_FLIPS.get(case_id, {}))


SHIPPED = {"grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "step_gae", "gigpo"}


def test_every_shipped_estimator_is_covered_with_the_inputs_it_reads():
    """CASES come from the registry, so a new estimator is checked as soon as it is registered;
    this guards against the registry losing one, and checks that gigpo really gets anchors."""
    assert SHIPPED <= set(ADVANTAGE_ESTIMATORS.names())
    assert set(KNOWN_FLIPS) <= {case_id for case_id, _ in CASES}, "a documented flip names no registered case"
    inputs = inputs_for(group_batch("base", 4), 0.5, ())
    without = dataclasses.replace(inputs, step_anchors=torch.full_like(inputs.step_anchors, -1))
    gigpo = ADVANTAGE_ESTIMATORS.get("gigpo")
    assert not torch.allclose(gigpo(inputs).advantages, gigpo(without).advantages)  # the anchors matter


def group_batch(condition: str, size: int) -> GroupBatch:
    """A composition with both choices and both outcomes (one episode of each kind)."""
    return next(b for b in group_batches(CONDITIONS[condition], size) if b.counts == (1,) * 4)


def test_the_mdp_is_worked_by_hand():
    assert CONDITIONS["base"].expected_return(True) == pytest.approx(0.7)
    assert CONDITIONS["base"].expected_return(False) == pytest.approx(0.3)
    assert CONDITIONS["k=2,c=-0.1"].expected_return(True) == pytest.approx(0.7 - 0.4)
    assert CONDITIONS["c=-0.3"].expected_return(False) == pytest.approx(0.0)
    for mdp in CONDITIONS.values():  # every condition keeps TOOL the better choice
        assert true_gap(mdp) == pytest.approx(0.4 + (1 + mdp.extra_tool_steps) * mdp.step_reward)
        assert true_gap(mdp) > 0.05
    # The enumeration's expected score per choice is the hand-worked return.
    def score(batch, q):
        return batch.layout.token_rewards.sum(-1, keepdim=True).expand_as(batch.layout.token_rewards)
    for cond in ("base", "k=2,c=-0.1"):
        exact = expected_first_advantages(score, CONDITIONS[cond], 0.3, 4)
        assert exact.tool == pytest.approx(CONDITIONS[cond].expected_return(True))
        assert exact.answer == pytest.approx(CONDITIONS[cond].expected_return(False))
    # The exact values: the mixture at the first action token, the coin's mean after it.
    batch = group_batch("c=-0.1", 4)
    values = batch.exact_values(0.25)
    first = batch.first_action_column(0)
    assert float(values[0, first]) == pytest.approx(0.25 * 0.5 + 0.75 * 0.2)
    tool = batch.kinds.index(next(k for k in batch.kinds if k.tool))
    assert float(values[tool, first + 1]) == pytest.approx(0.5)  # V_TOOL = 0.7 - 0.2
    answer_step = batch.layout.step_spans[tool][-1]
    assert float(values[tool, answer_step.start]) == pytest.approx(0.7 - 0.1)


# Unbiased by construction: the exact gap in closed form, for every condition, q and G.
#   rloo: A = R - mean(others), E[A | choice] = V_choice - V, gap = V_TOOL - V_ANSWER;
#   grpo without std (Dr.GRPO): R - mean(all) = (G - 1)/G (R - mean(others)): (G - 1)/G of it;
#   gigpo without std: that, twice (episode level + the start-state anchor group of first steps);
#   gae / step_gae with the exact values, any lam, no whitening: E[delta_t | choice] = 0 after the
#   choice, so only delta_0 differs: V_TOOL - V_ANSWER.
EXACT = {
    "rloo": lambda size: 1.0,
    "grpo[norm_by_std=False]": lambda size: (size - 1) / size,
    "gigpo[norm_by_std=False]": lambda size: 2 * (size - 1) / size,
    **{f"{name}[lam={lam},whiten=False]": (lambda size: 1.0) for name in ("gae", "step_gae") for lam in (1.0, 0.9)},
}


EXACT_CASES = [case for case in CASES if case[0] in EXACT]


@pytest.mark.parametrize("case_id, options", EXACT_CASES, ids=[case_id for case_id, _ in EXACT_CASES])
def test_unbiased_estimators_give_the_exact_gap(case_id, options):
    measured = registered_gaps(case_id.split("[")[0], options)
    for (cond, q, size), gap in measured.items():
        assert gap == pytest.approx(EXACT[case_id](size) * true_gap(CONDITIONS[cond]), abs=1e-5), (cond, q, size)


# Longer episodes (k extra no-op steps) change the gap only through a token-weighted batch
# whitening: more tokens in the batch, a smaller std, a larger advantage (magnitude, not sign).
# Measured E[A_0|TOOL] - E[A_0|ANSWER] at q = 0.5, G = 4: (k = 0, k = 3); every other case is
# exactly the same for every k.
WHITENED_LENGTH_DRIFT = {
    "reinforce_pp": (0.6797, 0.8919), "reinforce_pp_baseline": (0.6797, 0.8919),
    "gae[lam=1.0,whiten=True]": (1.2000, 1.6063), "gae[lam=0.9,whiten=True]": (1.3405, 1.7761),
    "step_gae[lam=1.0,whiten=True]": (0.7999, 1.1674), "step_gae[lam=0.9,whiten=True]": (0.8286, 1.2439),
}


@pytest.mark.parametrize("case_id, options", CASES, ids=[case_id for case_id, _ in CASES])
def test_longer_episodes_move_the_gap_only_through_whitening(case_id, options):
    measured = registered_gaps(case_id.split("[")[0], options)
    if case_id in WHITENED_LENGTH_DRIFT:
        assert (measured[("base", 0.5, 4)], measured[("k=3", 0.5, 4)]) == pytest.approx(
            WHITENED_LENGTH_DRIFT[case_id], abs=2e-4)
        return
    for (cond, q, size), gap in measured.items():
        if cond.startswith("k=") and "c=" not in cond:
            assert gap == pytest.approx(measured[("base", q, size)], abs=1e-5), (cond, q, size)


def test_the_exact_gap_check_fails_if_an_estimator_is_replaced_by_grpo():
    measured = gaps(ADVANTAGE_ESTIMATORS.get("grpo"), (), group_sizes=(4,))
    assert measured[("base", 0.5, 4)] != pytest.approx(true_gap(CONDITIONS["base"]), abs=1e-3)  # rloo's, gae's


def test_reinforce_pp_bias_fades_as_the_batch_grows():
    """The flips of reinforce_pp at 4 episodes per batch are gone at 8: the episode's own share of
    the whitening mean shrinks as 1 / batch tokens (in the pipeline the batch is the iteration)."""
    estimator = ADVANTAGE_ESTIMATORS.get("reinforce_pp")
    for cond, at_four in (("c=-0.3", -0.0462), ("k=2,c=-0.1", -0.1281)):
        def advantages(batch, q):
            return estimator(inputs_for(batch, q, ())).advantages
        assert expected_first_advantages(advantages, CONDITIONS[cond], 0.2, 4).gap == pytest.approx(at_four, abs=2e-4)
        assert expected_first_advantages(advantages, CONDITIONS[cond], 0.2, 8).gap > 0.1


# ------------------------------------------------ teeth: wrong estimators the same check catches

def step_table(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(step index [E, T] (-1 off steps), step rewards [E, K], present [E, K]) of the grid."""
    on = inputs.mask.to(torch.bool)
    step = inputs.step_starts.to(torch.long).cumsum(-1) - 1
    step = torch.where(on & (step >= 0), step, -1)
    num_steps = int(step.max()) + 1
    rewards = torch.zeros(step.shape[0], num_steps, dtype=torch.float64)
    rewards = rewards.scatter_add(1, step.clamp(min=0), torch.where(step >= 0, inputs.token_rewards.double(), 0.0))
    present = torch.arange(num_steps)[None, :] < inputs.step_starts.sum(-1, keepdim=True)
    return step, rewards, present


def per_step_output(per_step: torch.Tensor, step: torch.Tensor) -> AdvantageOutput:
    grid = torch.where(step >= 0, per_step.gather(1, step.clamp(min=0)), 0.0).float()
    return AdvantageOutput(advantages=grid, returns=grid)


def per_turn_index_normalised(inputs: AdvantageInputs) -> AdvantageOutput:
    """MT-GRPO-style turn-level advantages (verl-project/verl#7244): each turn's reward normalised
    among the group's episodes that reached that turn index, then summed over the turns from k
    on. The baseline's number of terms is set by the episode's own length: action-dependent."""
    step, rewards, present = step_table(inputs)
    normalised = torch.zeros_like(rewards)
    for k in range(rewards.shape[1]):
        for group in inputs.group_index.unique():
            members = present[:, k] & (inputs.group_index == group)
            turn = rewards[members, k]
            std = turn.std() if turn.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
            normalised[members, k] = (turn - turn.mean()) / (std + inputs.eps)
    return per_step_output(normalised.flip(-1).cumsum(-1).flip(-1), step)


def step_reward_without_baseline(inputs: AdvantageInputs) -> AdvantageOutput:
    """Naive: each step's own reward as its advantage (no return-to-go, no baseline)."""
    step, rewards, _ = step_table(inputs)
    return per_step_output(rewards, step)


def length_normalised_score(inputs: AdvantageInputs) -> AdvantageOutput:
    """Naive: the episode's mean reward per step, centred in its group (a per-step average)."""
    step, rewards, present = step_table(inputs)
    per_step = rewards.sum(-1) / present.sum(-1)
    centred = per_step - per_step.mean()  # the tests' batch is one group
    return per_step_output(centred[:, None].expand_as(rewards), step)


def test_per_turn_index_normalisation_is_caught_in_every_condition():
    """verl#7244's point: normalising per turn index compares a TOOL episode's answer turn only
    with other TOOL episodes, removing the very return that makes TOOL better, while its first
    turn (0 reward) is compared with the ANSWER episodes' outcomes: ANSWER wins everywhere."""
    measured = gaps(per_turn_index_normalised)
    with pytest.raises(AssertionError, match="sign flips"):
        assert_signs_kept(measured, {})
    assert set(flips(measured)) == set(measured)  # every condition, q and G


def test_a_step_reward_without_baseline_is_caught():
    measured = gaps(step_reward_without_baseline)
    with pytest.raises(AssertionError, match="sign flips"):
        assert_signs_kept(measured, {})
    # by hand: E[A_0 | TOOL] = c (the tool call's reward), E[A_0 | ANSWER] = 0.3 + c
    assert all(gap == pytest.approx(-0.3, abs=1e-6) for gap in measured.values())


def test_a_length_normalised_score_is_caught_by_longer_episodes_only():
    """Dividing by the number of steps keeps the sign for k = 0 (0.7 / 2 > 0.3) and under any c
    (it adds c to both), and flips it once TOOL takes 3+ steps: the k = 1..3 check has teeth."""
    measured = gaps(length_normalised_score)
    with pytest.raises(AssertionError, match="sign flips"):
        assert_signs_kept(measured, {})
    for (cond, q, size), gap in measured.items():
        k = CONDITIONS[cond].extra_tool_steps
        assert gap == pytest.approx((size - 1) / size * (0.7 / (2 + k) - 0.3), abs=1e-6)
        assert (gap < 0) == (k > 0)
