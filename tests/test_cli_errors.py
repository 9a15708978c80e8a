"""Bad command-line input fails early: exit code 2, one line on stderr, no traceback, nothing created,
and before a Prefect server is started."""

from __future__ import annotations

import pytest

import flows.cli as cli
from flows.cli import main as cli_main


@pytest.fixture
def no_server(monkeypatch):
    """Fail the test if a command got as far as configuring Prefect (which starts its server)."""
    def started(*args, **kwargs):
        raise AssertionError("the command configured Prefect before rejecting its input")
    monkeypatch.setattr(cli, "configure_environment", started)


def _one_line_error(capsys, expected: str) -> None:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentr1: error: ") and expected in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_unknown_stage(tmp_path, capsys, no_server):
    root = tmp_path / "data"
    assert cli_main(["rerun", "--run-id", "r", "--iteration", "0", "--stage", "rollut", "--data-root", str(root)]) == 2
    _one_line_error(capsys, "unknown --stage 'rollut'; valid stages: prepare_data, rollout")
    assert not root.exists()


def test_rerun_of_a_run_that_does_not_exist(tmp_path, capsys, no_server):
    root = tmp_path / "data"
    assert cli_main(["rerun", "--run-id", "nope", "--iteration", "0", "--stage", "rollout", "--data-root", str(root)]) == 2
    _one_line_error(capsys, "no run 'nope' under")
    assert not root.exists()


def test_a_data_root_that_is_a_file(tmp_path, capsys, no_server):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli_main(["train", "--config", "tiny", "--data-root", str(afile)]) == 2
    _one_line_error(capsys, "is a file; it must be a folder")
    assert afile.read_text() == "x"


def test_query_on_a_data_root_without_tables(tmp_path, capsys):
    root = tmp_path / "empty"
    assert cli_main(["query", "select 1", "--data-root", str(root)]) == 2
    _one_line_error(capsys, f"no tables under {root}")
    assert not root.exists()
