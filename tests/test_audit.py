"""The behaviour audit's checks by hand (issue 33): small synthetic run tables, written with the
project's writer; each built-in check stays quiet on a healthy iteration and fires on the failure it
names; the rules (absolute bounds, ratio to the run's first iterations) and what a check that cannot
run says. Fast: no training."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from agent_core.audit import BUILTIN_NAMES, audit_iterations, judged_iterations
from agent_core.audit.checks import Check
from agent_core.audit.evaluate import judge
from agent_core.config.audit import AuditConfig
from agent_core.envs.registry import env_offers_tools
from audit_tables import QUESTION, Action, Episode, Update, healthy, write_iteration

ANSWER = Action(text="<answer>Zurport</answer>", calls=(), observation="", answer="Zurport")
SEARCH = Action()


def _episodes(*actions: Action, n: int = 4, **kwargs) -> list[Episode]:
    return [Episode(actions=tuple(actions), **kwargs) for _ in range(n)]


BAD_ITERATIONS = {  # check -> (episodes, updates) of an iteration that must make it fire
    "failed_episode_rate": (_episodes(SEARCH, replace(SEARCH, failure="exit code 1: the agent fell over"), n=2)
                            + _episodes(SEARCH, ANSWER, n=2), None),
    "malformed_action_rate": (_episodes(*[replace(SEARCH, calls=(), parse_error="no call or answer")] * 3, ANSWER),
                              None),
    "tool_error_rate": (_episodes(replace(SEARCH, calls=(False, False)), ANSWER), None),
    "tool_calls_per_episode": (_episodes(ANSWER), None),  # collapse: answers without searching
    "unanswered_episode_rate": (_episodes(SEARCH, SEARCH), None),  # out of steps, never an answer
    "cut_action_rate": (_episodes(replace(SEARCH, cut=True), replace(ANSWER, cut=True)), None),
    "learning_signal_rate": (_episodes(SEARCH, ANSWER, em=0.0, advantage=0.0), None),  # every sample alike
    "steps_per_episode": (_episodes(*([SEARCH] * 7), ANSWER), None),  # runaway growth (baseline 2)
    "answer_copied_from_question": (_episodes(SEARCH, replace(ANSWER, answer="Vi Fin")), None),
    "answer_repeats_observation": (_episodes(SEARCH, replace(ANSWER, answer="Vi Fin is a film directed by Gos Kin.")),
                                   None),
    "repeated_action_rate": (_episodes(SEARCH, SEARCH, SEARCH, ANSWER), None),
    "token_repetition_rate": (_episodes(replace(SEARCH, ids=(7,) * 12), ANSWER), None),
    "response_length": (_episodes(replace(SEARCH, ids=tuple(range(40))), replace(ANSWER, ids=tuple(range(40)))), None),
    "format_process_reward": (_episodes(SEARCH, ANSWER, em=0.0, format_weight=1.0), None),
    "format_process_share": (_episodes(SEARCH, ANSWER, em=0.2, format_weight=0.3), None),
    "entropy": (healthy(), [Update(entropy=0.1)]),
    "kl": (healthy(), [Update(kl=5.0)]),
    "clipfrac": (healthy(), [Update(clipfrac=0.9)]),
    "nonfinite_updates": (healthy(), [Update(), Update(skipped=True, skip_reason="non-finite gradient norm (nan)")]),
    "skipped_update_rate": (healthy(), [Update(skipped=True, skip_reason="no gradient signal")] * 2),
}


def _run_with_bad_last(tmp_path, episodes, updates):
    """Iterations 0 and 1 healthy (the baseline), iteration 2 as given."""
    write_iteration(tmp_path, "r", 0, healthy())
    write_iteration(tmp_path, "r", 1, healthy())
    return write_iteration(tmp_path, "r", 2, episodes, updates)


def test_every_builtin_check_has_a_failure_case():
    assert sorted(BAD_ITERATIONS) == sorted(BUILTIN_NAMES)


def test_a_healthy_run_alerts_on_nothing(tmp_path):
    run = _run_with_bad_last(tmp_path, healthy(), None)
    rows = audit_iterations(run, AuditConfig(), [0, 1, 2])
    assert {r.check_name for r in rows} == set(BUILTIN_NAMES)
    assert [r.line() for r in rows if r.status != "ok"] == []


@pytest.mark.parametrize("name", sorted(BAD_ITERATIONS))
def test_each_builtin_check_fires_on_its_failure_and_only_there(tmp_path, name):
    episodes, updates = BAD_ITERATIONS[name]
    run = _run_with_bad_last(tmp_path, episodes, updates)
    rows = {r.check_name: r for r in audit_iterations(run, AuditConfig(), [2])}
    assert rows[name].status == "alert", rows[name].line()
    assert rows[name].detail  # says which bound broke
    # the baseline iterations stay clean
    assert all(r.status != "alert" for r in audit_iterations(run, AuditConfig(), [0, 1]))


@pytest.mark.parametrize("name", ["tool_calls_per_episode", "unanswered_episode_rate", "cut_action_rate",
                                  "malformed_action_rate", "format_process_reward", "learning_signal_rate"])
def test_behaviour_bad_from_the_first_iteration_is_flagged_there(tmp_path, name):
    """No trend to see: every iteration is as bad as the first; the absolute bound must say so at 0."""
    episodes, updates = BAD_ITERATIONS[name]
    for k in range(3):
        run = write_iteration(tmp_path, "r", k, episodes, updates)
    rows = {(r.iteration, r.check_name): r for r in audit_iterations(run, AuditConfig(), [0, 1, 2])}
    assert [rows[k, name].status for k in range(3)] == ["alert"] * 3, rows[0, name].line()


def test_the_tool_checks_are_not_run_for_an_env_without_tools(tmp_path):
    run = _run_with_bad_last(tmp_path, *BAD_ITERATIONS["tool_calls_per_episode"])
    with_tools = {r.check_name: r.status for r in audit_iterations(run, AuditConfig(), [2])}
    without = {r.check_name for r in audit_iterations(run, AuditConfig(), [2], offers_tools=False)}
    assert with_tools["tool_calls_per_episode"] == "alert" and "tool_error_rate" in with_tools
    assert set(with_tools) - without == {"tool_calls_per_episode", "tool_error_rate"}
    assert not env_offers_tools("tool_env", {"tools": []})
    assert env_offers_tools("tool_env", {}) and env_offers_tools("search_qa", {}) and env_offers_tools(None, {})
    assert env_offers_tools("agent_program", {"command": ["python", "agent.py"]})  # declared per request


def test_a_threshold_override_silences_one_check_and_disables_another(tmp_path):
    run = _run_with_bad_last(tmp_path, *BAD_ITERATIONS["tool_error_rate"])
    loose = AuditConfig(thresholds={"tool_error_rate": {"max": 1.0}, "kl": {"enabled": False}})
    rows = {r.check_name: r for r in audit_iterations(run, loose, [2])}
    assert rows["tool_error_rate"].status == "ok" and rows["tool_error_rate"].rule == "max 1"
    assert "kl" not in rows


def test_trend_rules_wait_for_the_baseline_and_compare_with_its_mean():
    check = Check("c", "", "", min_ratio=0.5, max_ratio=2.0)
    values = {0: 1.0, 1: 3.0, 2: 0.9, 3: 4.5}
    assert judge(check, values, "r", 1, 2).status == "ok"  # a baseline iteration: absolute bounds only
    assert judge(check, values, "r", 1, 2).baseline is None
    low, high = judge(check, values, "r", 2, 2), judge(check, values, "r", 3, 2)
    assert (low.status, low.baseline, round(low.ratio, 3)) == ("alert", 2.0, 0.45)
    assert (high.status, high.ratio) == ("alert", 2.25)
    assert judge(check, {0: 0.0, 1: 0.0, 2: 5.0}, "r", 2, 2).status == "ok"  # a zero baseline has no ratio
    assert judge(check, {0: 1.0}, "r", 2, 2).status == "no_data"
    nan = judge(Check("c", "", ""), {0: math.nan}, "r", 0, 2)
    assert nan.status == "alert" and "nan" in nan.detail


def test_a_missing_table_is_said_not_raised(tmp_path):
    run = _run_with_bad_last(tmp_path, healthy(), None)
    (run.iteration_dir(2) / "train_metrics.parquet").unlink()
    rows = {r.check_name: r for r in audit_iterations(run, AuditConfig(), [2])}
    assert rows["kl"].status == "error"
    assert "missing table train_metrics" in rows["kl"].detail and "\n" not in rows["kl"].detail
    assert rows["steps_per_episode"].status == "ok"  # checks over other tables still answer


def test_a_corrupt_table_is_said_not_raised(tmp_path):
    run = _run_with_bad_last(tmp_path, healthy(), None)
    path = run.iteration_dir(2) / "steps.parquet"
    path.write_bytes(path.read_bytes()[:200])
    rows = {r.check_name: r for r in audit_iterations(run, AuditConfig(), [2])}
    assert rows["malformed_action_rate"].status == "error"
    assert "steps" in rows["malformed_action_rate"].detail and "\n" not in rows["malformed_action_rate"].detail
    assert rows["kl"].status == "ok"


def test_an_audit_reads_only_the_audited_and_the_baseline_iterations(tmp_path):
    """Iteration 4's verdict depends on iterations 0, 1 (the baseline) and 4: what its manifest records
    as inputs (tasks/audit.py). A damaged iteration 2 or 3 must not reach it, and its cost must not
    grow with the run's length."""
    for k in range(5):
        run = write_iteration(tmp_path, "r", k, healthy())
    for k in (2, 3):
        path = run.iteration_dir(k) / "steps.parquet"
        path.write_bytes(path.read_bytes()[:200])
    rows = audit_iterations(run, AuditConfig(), [4])
    assert [r.line() for r in rows if r.status != "ok"] == []
    assert judged_iterations([4], 2) == {0, 1, 4} and judged_iterations([1], 2) == {0, 1}
    assert judged_iterations([0], 2) == {0} and judged_iterations([2, 6], 3) == {0, 1, 2, 6}
    assert {r.status for r in audit_iterations(run, AuditConfig(), [3]) if r.check_name == "malformed_action_rate"} \
        == {"error"}  # the damaged table is read when it is the audited iteration's


def test_a_user_check_runs_through_the_read_only_catalog(tmp_path):
    run = _run_with_bad_last(tmp_path, healthy(), None)
    cfg = AuditConfig(checks=[{"name": "answers_per_episode", "max": 0.5,
                               "sql": "select iteration, count(*) filter (where termination = 'answered')::double"
                                      " / count(distinct episode_id) as value from steps group by iteration"}])
    rows = {r.check_name: r for r in audit_iterations(run, cfg, [2])}
    assert (rows["answers_per_episode"].status, rows["answers_per_episode"].value) == ("alert", 1.0)
    assert rows["answers_per_episode"].source == "user"


def test_a_question_that_names_the_answer_is_copying(tmp_path):
    """The copy check reads the prompt's own text: an answer the question already names."""
    run = write_iteration(tmp_path, "r", 0, _episodes(SEARCH, ANSWER), question=f"{QUESTION} (Zurport?)")
    rows = {r.check_name: r for r in audit_iterations(run, AuditConfig(), [0])}
    assert rows["answer_copied_from_question"].value == 1.0


def test_a_check_past_its_time_limit_is_an_error_row_not_a_hang(tmp_path):
    """Issue 55: a user check over range(10^11) ran 150 s until Ctrl-C; now it stops at audit.check_timeout_s."""
    run = _run_with_bad_last(tmp_path, healthy(), None)
    cfg = AuditConfig(check_timeout_s=1.0, checks=[{
        "name": "endless", "max": 1.0,
        "sql": "select iteration, (select count(*) from range(100000000000) t(i) where i % 7 = 3)::double as value "
               "from steps group by iteration"},
        {"name": "after_it", "max": 1e9, "sql": "select iteration, count(*)::double as value from steps group by 1"}])
    rows = {r.check_name: r for r in audit_iterations(run, cfg, [2])}
    assert rows["endless"].status == "error" and "timed out after 1 s" in rows["endless"].detail
    assert "\n" not in rows["endless"].detail
    assert rows["after_it"].status == "ok"  # the check after it still ran, on the same catalog
