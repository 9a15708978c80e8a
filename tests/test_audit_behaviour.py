"""The audit on trained runs (issue 33, slow: trains a small policy on the built-in task).

A policy warm-started on "lazy" scripted episodes (search once, then answer the bridge entity: well
formed and wrong) is trained with a format bonus as large as the task reward: its reward is paid by
the format term, not by EM, and the audit flags it within the first iterations. The same tables
relabelled with the demo's bonus (0.1) do not alert on that check: the flag is the bonus, not the
policy. Then one iteration's rollout is redone with the tools taken away (the env's tool budget set
to 0: every call refused), and the audit flags the switch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_core.audit import audit_iterations
from agent_core.config.audit import AuditConfig
from agent_core.io.layout import DataRoot
from agent_core.io.run_catalog import health_uri
from agent_core.io.tables import read_table
from flows.cli import main as cli_main
from flows.rerun import rerun_stage

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
RUN = "gamed"
LAZY_POLICY = ["data.num_films=2000", "data.num_people=2000", "data.num_cities=40", "data.num_countries=12",
               "data.top_k=1", "policy.hidden_size=128", "policy.num_layers=4", "policy.num_heads=4",
               "policy.intermediate_size=256", "warm_start.enabled=true", "warm_start.prompts=1600",
               "warm_start.lazy_fraction=1.0", "warm_start.epochs=1", "warm_start.lr=0.001", "dev_eval.every=0",
               "iterations=3",
               "checkpoints.keep_last=2"]  # the last test reruns iteration 2's rollout, which reads checkpoint 1


@pytest.fixture(scope="module")
def gamed(tmp_path_factory):
    root = tmp_path_factory.mktemp("gamed")
    args = ["train", "--config", str(REPO / "configs" / "tiny.yaml"), "--run-id", RUN, "--data-root", str(root)]
    for override in [*LAZY_POLICY, "reward.format_weight=1.0"]:
        args += ["--set", override]
    assert cli_main(args) == 0
    return root, DataRoot(root).run(RUN)


def _status(run, iteration: int, check: str) -> str:
    rows = read_table("health", health_uri(run, iteration)).to_pylist()
    return next(r["status"] for r in rows if r["check_name"] == check)


def test_a_reward_paid_by_its_format_term_is_flagged_within_a_few_iterations(gamed):
    _, run = gamed
    flagged = [k for k in range(3) if _status(run, k, "format_process_reward") == "alert"]
    assert flagged and flagged[0] <= 1, flagged


def test_the_same_behaviour_with_the_demo_bonus_is_not_flagged(gamed):
    root, run = gamed
    for k in range(3):
        rerun_stage(str(root), RUN, k, "label_rewards", ["reward.format_weight=0.1"])
    rows = audit_iterations(run, AuditConfig(), [0, 1, 2])
    assert [r.line() for r in rows if r.check_name == "format_process_reward" and r.status != "ok"] == []


def test_tools_taken_away_mid_run_are_flagged(gamed, capsys):
    root, run = gamed
    before = {r.check_name: r.status for r in audit_iterations(run, AuditConfig(), [2])}
    assert before["tool_error_rate"] == "ok" and before["tool_calls_per_episode"] == "ok"
    rerun_stage(str(root), RUN, 2, "rollout", ["rollout.env_kwargs={max_tool_calls_per_episode: 0}"])
    assert cli_main(["audit", "--run-id", RUN, "--data-root", str(root)]) == 1
    assert "iteration 2 tool_error_rate: alert" in capsys.readouterr().out
