"""The audit in the loop and on the command line (issue 33): the `audit:` config section (a user
check, an invalid one refused at config check in one line), `agentr1 audit` exit codes 0/1/2 over
synthetic tables, and (slow: trains the tiny config) `audit.on_alert: stop` ending a run as
`stopped` with its reason in `agentr1 runs`, the health table, and a resume that continues."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent_core.config.audit import AuditConfig
from agent_core.config import ConfigError
from agent_core.io.config_files import save_config
from agent_core.io.layout import DataRoot
from agent_core.io.run_status import run_status
from agent_core.io.tables import read_table
from agent_core.validation import build_config, load_config
from audit_tables import Action, Episode, Update, healthy, write_iteration
from flows.cli import AUDIT_STOPPED, main as cli_main

REPO = Path(__file__).resolve().parent.parent
ALWAYS = {"name": "always_alerts", "sql": "select iteration, 1.0 as value from steps group by iteration", "max": 0.0}


def test_a_user_check_in_the_config_is_accepted():
    config = build_config({"audit": {"checks": [ALWAYS], "thresholds": {"kl": {"max": 2.0}}, "on_alert": "stop"}})
    assert config.audit.checks[0].name == "always_alerts" and config.audit.thresholds["kl"].max == 2.0


@pytest.mark.parametrize("sql, said", [
    ("select iteration, avg(no_such_column) as value from steps group by iteration", "no_such_column"),
    ("select iteration from steps", "must return a column named value"),
    ("copy steps to 'x.csv'", "refused a statement of type COPY"),
    ("select iteration, 1 as value from read_csv('/etc/passwd')", "passwd"),
])
def test_an_invalid_user_check_fails_at_config_check_in_one_line(sql, said):
    with pytest.raises(ConfigError) as raised:
        build_config({"audit": {"checks": [{"name": "mine", "sql": sql, "max": 1.0}]}})
    message = str(raised.value)
    assert "audit.checks.0.sql" in message and said in message
    assert not any("LINE 1" in line for line in message.splitlines())


def test_unknown_threshold_names_and_builtin_name_clashes_are_refused():
    with pytest.raises(ConfigError, match="no built-in check is named 'klx'"):
        build_config({"audit": {"thresholds": {"klx": {"max": 1.0}}}})
    with pytest.raises(ConfigError, match="built-in check's name"):
        build_config({"audit": {"checks": [{**ALWAYS, "name": "kl"}]}})
    with pytest.raises(ConfigError, match="no bound"):
        build_config({"audit": {"checks": [{"name": "x", "sql": ALWAYS["sql"]}]}})


def _recorded_run(root: Path, run_id: str, audit: dict | None = None):
    config = load_config(REPO / "configs" / "tiny.yaml", [f"data_root={root}", f"run_id={run_id}"])
    if audit:
        config = build_config({**config.model_dump(mode="json"), "audit": audit})
    run = DataRoot(root).run(run_id)
    save_config(config, run.config_path)
    return run


def test_agentr1_audit_exit_codes(tmp_path, capsys):
    _recorded_run(tmp_path, "healthy")
    _recorded_run(tmp_path, "sick")
    for k in range(3):
        write_iteration(tmp_path, "healthy", k, healthy())
        write_iteration(tmp_path, "sick", k, healthy() if k < 2 else [Episode(actions=(Action(
            text="<answer>x</answer>", calls=(), observation="", answer="xyz"),))] * 4)
    args = ["audit", "--data-root", str(tmp_path), "--run-id"]
    assert cli_main([*args, "healthy"]) == 0
    assert "0 alert" not in capsys.readouterr().out
    assert cli_main([*args, "sick"]) == 1
    out = capsys.readouterr().out
    assert "iteration 2 tool_calls_per_episode: alert" in out and "failing: " in out
    assert cli_main([*args, "no-such-run"]) == 2
    assert "no-such-run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        cli_main(["audit", "--data-root", str(tmp_path)])  # --run-id missing
    assert usage.value.code == 2


def test_agentr1_audit_says_a_damaged_table_and_fails(tmp_path, capsys):
    _recorded_run(tmp_path, "r")
    for k in range(2):
        write_iteration(tmp_path, "r", k, healthy(), [Update()])
    path = DataRoot(tmp_path).run("r").iteration_dir(1) / "rewards.parquet"
    path.write_bytes(b"not parquet at all")
    assert cli_main(["audit", "--data-root", str(tmp_path), "--run-id", "r"]) == 1
    out = capsys.readouterr().out
    assert "iteration 1 format_process_reward: error" in out and "could not run" in out


def test_a_user_check_from_the_recorded_config_runs_in_agentr1_audit(tmp_path, capsys):
    _recorded_run(tmp_path, "r", {"checks": [ALWAYS]})
    write_iteration(tmp_path, "r", 0, healthy())
    assert cli_main(["audit", "--data-root", str(tmp_path), "--run-id", "r"]) == 1
    assert "iteration 0 always_alerts: alert" in capsys.readouterr().out


def test_agentr1_audit_takes_more_checks_for_a_finished_run(tmp_path, capsys):
    _recorded_run(tmp_path, "r")
    for k in range(2):
        write_iteration(tmp_path, "r", k, healthy())
    args = ["audit", "--data-root", str(tmp_path), "--run-id", "r"]
    assert cli_main(args) == 0
    extra = tmp_path / "more.yaml"
    extra.write_text(yaml.safe_dump({"checks": [ALWAYS], "thresholds": {"steps_per_episode": {"max": 1.0}}}))
    assert cli_main([*args, "--checks", str(extra)]) == 1
    out = capsys.readouterr().out
    assert "iteration 0 always_alerts: alert" in out and "iteration 1 steps_per_episode: alert" in out
    extra.write_text(yaml.safe_dump({"audit": {"checks": [{**ALWAYS, "sql": "select iteration from stepz"}]}}))
    assert cli_main([*args, "--checks", str(extra)]) == 2
    err = capsys.readouterr().err
    assert "audit.checks.0.sql" in err and "stepz" in err and str(extra) in err
    extra.write_text("- just a list\n")
    assert cli_main([*args, "--checks", str(extra)]) == 2
    assert "expected the keys of an audit section" in capsys.readouterr().err


@pytest.mark.slow
def test_on_alert_stop_ends_the_run_with_its_reason_and_a_resume_continues(tmp_path, capsys):
    extra = tmp_path / "audit.yaml"
    extra.write_text(yaml.safe_dump({"iterations": 3, "audit": {"on_alert": "stop", "checks": [ALWAYS]}}))
    root = tmp_path / "data"
    assert cli_main(["train", "--config", str(REPO / "configs" / "tiny.yaml"), "--config", str(extra),
                     "--run-id", "s", "--data-root", str(root)]) == AUDIT_STOPPED  # not 0: the run did not finish
    assert "stopped early: audit alert at iteration 0" in capsys.readouterr().out
    run = DataRoot(root).run("s")
    status = run_status(run)
    assert (status.status, status.iterations_done) == ("stopped", 1)
    assert "always_alerts" in status.detail
    assert cli_main(["runs", "--data-root", str(root)]) == 0
    assert "stopped" in capsys.readouterr().out
    health = read_table("health", run.iteration_dir(0) / "health.parquet").to_pylist()
    assert {"always_alerts": "alert"}.items() <= {r["check_name"]: r["status"] for r in health}.items()
    assert "always_alerts" in (run.report_dir / "health.md").read_text()
    # the resume does not stop again on iteration 0's alert: it runs iteration 1, whose audit stops it
    assert cli_main(["resume", "--run-id", "s", "--data-root", str(root)]) == AUDIT_STOPPED
    assert (run_status(run).status, run_status(run).iterations_done) == ("stopped", 2)
    # with on_alert warn, the resume runs to the end
    assert cli_main(["resume", "--run-id", "s", "--data-root", str(root), "--set", "audit.on_alert=warn"]) == 0
    assert (run_status(run).status, run_status(run).iterations_done) == ("finished", 3)


def test_the_audit_task_writes_health_and_stops_once(tmp_path, monkeypatch):
    """The stage's body (no flow): the health table, report and Prefect artifact, the stop flag of a
    fresh alert, and a second call over the same tables and settings (a resume) that reads its verdict
    back and does not stop."""
    import tasks.audit
    from tasks.audit import audit_iteration

    artifacts = []  # Prefect's own call starts a temporary API server outside a flow (~1 min here)
    monkeypatch.setattr(tasks.audit, "create_markdown_artifact", lambda **kwargs: artifacts.append(kwargs))

    run = write_iteration(tmp_path, "r", 0, healthy())
    quiet = audit_iteration.fn(run, 0, AuditConfig(on_alert="stop"))
    assert (quiet.stop, quiet.alerts) == (False, [])
    stop = AuditConfig(on_alert="stop", checks=[ALWAYS])
    first = audit_iteration.fn(run, 0, stop)
    assert first.stop and first.failing_checks == ["always_alerts"] and "iteration 0" in first.reason
    rows = read_table("health", first.health_uri).to_pylist()
    assert {r["check_name"]: r["status"] for r in rows}["always_alerts"] == "alert"
    assert "always_alerts" in (run.report_dir / "health.md").read_text()
    assert len(artifacts) == 1 and "always_alerts" in artifacts[0]["markdown"]
    again = audit_iteration.fn(run, 0, stop)
    assert (again.stop, again.failing_checks) == (False, ["always_alerts"])
    assert audit_iteration.fn(run, 0, AuditConfig(enabled=False)).health_uri is None
