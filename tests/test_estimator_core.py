"""The estimator input, the dispatcher, registration on any import, and no import cycle in algos."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent_core.algos import advantages, estimators_critic, gigpo
from agent_core.algos.estimator_core import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    estimate_advantages,
    estimator_ignores_advantage_mask,
    estimator_uses_critic,
)

ALGOS = Path(__file__).resolve().parents[1] / "agent_core" / "algos"
PACKAGE = "agent_core.algos"

REWARDS = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 2.0]])
MASK = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1]])
GROUPS = torch.tensor([5, 5, 5])  # no group of one: no GroupOfOneWarning
VALUES = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0], [0.2, 0.1, 0.4]])
STARTS = torch.tensor([[True, False, False], [True, False, False], [True, False, True]])
ANCHORS = torch.tensor([[0, -1, -1], [0, -1, -1], [0, -1, 1]])  # gigpo: every step 0 starts from one state


def algos_imports(path: Path) -> set[str]:
    """The agent_core.algos submodules `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            names = [f"{PACKAGE}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.removeprefix(f"{PACKAGE}.").split(".")[0] for name in names if name.startswith(f"{PACKAGE}.")}
    return found


def test_no_module_of_algos_imports_one_that_imports_it_back():
    graph = {path.stem: algos_imports(path) for path in ALGOS.glob("*.py") if path.stem != "__init__"}
    assert graph["estimator_core"] == set()  # the base module of the estimators
    assert "estimators_critic" not in graph["advantages"] and "advantages" not in graph["estimators_critic"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(module for module in graph if reaches(module, module, {module}))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_any_algos_import_registers_every_estimator():
    # A fresh interpreter: in this one the estimators are registered already.
    code = (
        "from agent_core.algos.estimator_core import ADVANTAGE_ESTIMATORS, estimator_uses_critic\n"
        "print(','.join(ADVANTAGE_ESTIMATORS.names()), estimator_uses_critic('step_gae'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["gae,gigpo,grpo,reinforce_pp,reinforce_pp_baseline,rloo,step_gae", "True"]


def test_registered_estimators_are_the_module_functions_and_the_dispatcher_calls_them():
    functions = {
        "grpo": advantages.grpo_advantages, "rloo": advantages.rloo_advantages,
        "reinforce_pp": advantages.reinforce_pp_advantages,
        "reinforce_pp_baseline": advantages.reinforce_pp_baseline_advantages,
        "gae": estimators_critic.gae_advantages, "step_gae": estimators_critic.step_gae_advantages,
        "gigpo": gigpo.gigpo_advantages,
    }
    assert set(functions) == set(ADVANTAGE_ESTIMATORS.names())
    inputs = AdvantageInputs(REWARDS, MASK, GROUPS, VALUES, step_starts=STARTS, gamma=0.9, lam=0.8, whiten=True,
                             step_anchors=ANCHORS)
    for name, function in functions.items():
        assert ADVANTAGE_ESTIMATORS.get(name) is function
        direct, dispatched = function(inputs), estimate_advantages(name, inputs)
        assert torch.equal(direct.advantages, dispatched.advantages) and torch.equal(direct.returns, dispatched.returns)
    assert [n for n in functions if estimator_uses_critic(n)] == ["gae", "step_gae"]
    assert [n for n in functions if estimator_ignores_advantage_mask(n)] == ["grpo", "rloo"]


def test_inputs_are_frozen_and_settings_keyword_only():
    inputs = AdvantageInputs(REWARDS, MASK, GROUPS)
    assert inputs.values is None and inputs.step_starts is None
    assert (inputs.gamma, inputs.lam, inputs.eps, inputs.norm_by_std, inputs.whiten) == (1.0, 1.0, 1e-6, True, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.gamma = 0.5
    with pytest.raises(TypeError):
        AdvantageInputs(REWARDS, MASK, GROUPS, VALUES, STARTS)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(token_rewards=REWARDS[0]), "token_rewards must be"),
        (dict(step_starts=STARTS[:, :2]), "step_starts shape"),
        (dict(group_index=GROUPS.float()), "integer tensor"),
    ],
)
def test_inputs_are_checked_on_construction(kwargs, match):
    fields = dict(token_rewards=REWARDS, mask=MASK, group_index=GROUPS) | kwargs
    with pytest.raises(ValueError, match=match):
        AdvantageInputs(**fields)
