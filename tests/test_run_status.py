"""`agentr1 runs`: each run's status (running, finished, failed, killed), iterations, last dev EM, algorithm, disk use."""

from __future__ import annotations

import math

import pytest

from agent_core.io.disk_use import disk_use, human_bytes
from agent_core.io.layout import DataRoot
from agent_core.io.locks import run_lock
from agent_core.io.run_status import record_run_end, run_status
from flows.cli import main as cli_main
from tasks.run_config import recording_end


@pytest.fixture
def run(tmp_path):
    run = DataRoot(tmp_path).run("r1")
    run.run_dir.mkdir(parents=True)
    run.config_path.write_text("iterations: 3\nalgorithm:\n  estimator: rloo\n")
    for k in (0, 1):  # iteration 1 started but its tracking stage never committed
        run.iteration_dir(k).mkdir()
    run.manifest_path("log_iteration", 0).parent.mkdir(parents=True)
    run.manifest_path("log_iteration", 0).write_text("{}")
    return run


def test_a_run_that_recorded_no_end_and_holds_no_lock_was_killed(run):
    status = run_status(run)
    assert (status.status, status.iterations_done, status.iterations_planned, status.algorithm) == ("killed", 1, 3, "rloo")
    assert math.isnan(status.last_dev_em) and status.detail is None


def test_a_live_writer_makes_it_running(run):
    with run_lock(run.lock_path, run.run_id):
        assert run_status(run).status == "running"
    assert run_status(run).status == "killed"


def test_the_recorded_end_and_the_error_of_a_failed_run(run):
    with pytest.raises(RuntimeError, match="boom"):
        with recording_end(run):
            raise RuntimeError("boom\nsecond line")
    status = run_status(run)
    assert status.status == "failed" and status.detail == "RuntimeError: boom"
    with recording_end(run):
        pass
    assert run_status(run).status == "finished" and run_status(run).detail is None
    with pytest.raises(ValueError, match="valid: finished, failed"):
        record_run_end(run, "done")


def test_cli_runs_prints_a_row_per_run(run, capsys):
    record_run_end(run, "failed", "ValueError: bad")
    assert cli_main(["runs", "--data-root", str(run.data_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "status", "iterations", "dev", "EM", "failed", "episodes", "algorithm", "disk"]
    size = disk_use(run.run_dir)  # a few folders and files: some kB
    assert lines[1].split() == ["r1", "failed", "1/3", "-", "0/0", "rloo", *human_bytes(size).split(), "(ValueError:", "bad)"]
    assert lines[2] == f"total: {human_bytes(size)} on disk in 1 run" and len(lines) == 3
