"""`agentr1 runs` over a data root with damaged runs (issue 39 item 8): every readable run is
listed, each problem is one line naming the run (or mlflow.db) and what is wrong, hidden folders
are skipped, and the exit code is 1 when anything was unreadable (0 otherwise). Each row ends with the
run folder's disk use (as `du` counts it: a hard link once), and the last line is the total.

The runs are real folders with the files `agentr1 runs` reads (config.yaml, status.json, the
log_iteration manifest, a dev_eval table written by the real writer): no training needed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from agent_core.io.disk_use import human_bytes
from agent_core.io.layout import DataRoot
from agent_core.io.run_status import record_run_end
from agent_core.io.tables import write_table
from flows.cli import main as cli_main
from tests.test_schemas import steps_rows
from tests.test_yaml_limits import bomb

HEADER = ["run", "status", "iterations", "dev", "EM", "failed", "episodes", "algorithm", "disk"]
SIZE = re.compile(r"^(\d+ B|\d+\.\d [kMGTP]B)$")


def _make_run(root: DataRoot, run_id: str, iterations_done: int = 2, em: float = 0.5) -> None:
    run = root.run(run_id)
    run.run_dir.mkdir(parents=True)
    run.config_path.write_text("iterations: 3\nalgorithm:\n  estimator: grpo\n")
    for k in range(iterations_done):
        run.manifest_path("log_iteration", k).parent.mkdir(parents=True)
        run.manifest_path("log_iteration", k).write_text("{}")
        rows = [{"eval_id": f"{run_id}-dev", "method": "agent", "checkpoint": "c", "data_source": "synthetic",
                 "split": "dev", "seed": 0, "prompt_id": f"q{i}", "prediction": "x", "em": float(i < 2 * em),
                 "f1": 0.0, "format_ok": True, "steps": 1, "tool_calls": 0, "termination": "answered"} for i in range(2)]
        write_table("eval", rows, run.dev_eval_uri(k))
    steps = steps_rows()  # two episodes, ep-1 ended in an error
    for row in steps:
        if row["done"] and row["episode_id"] == "ep-1":
            row.update(termination="error", info='{"error": "exit code 1"}')
    write_table("steps", steps, run.table_uri(0, "steps"))
    record_run_end(run, "finished")


@pytest.fixture
def root(tmp_path) -> DataRoot:
    """Two good runs (a-good, z-good) around the one each test damages (m-bad)."""
    root = DataRoot(tmp_path / "data")
    for run_id in ("a-good", "m-bad", "z-good"):
        _make_run(root, run_id)
    return root


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _link_to_dev_zero(path: Path) -> None:
    """A run file made a link to /dev/zero (issue 55 item 9): read, it never ends (6.8 GB before)."""
    path.unlink()
    path.symlink_to("/dev/zero")


NO_CONFIG = ["m-bad", "finished", "2/?", "0.500", "1/2", "?"]
# damage -> (the file its one line names, the row still listed: `?` where the damage hides a value)
DAMAGE = {
    "truncated dev_eval": (lambda run: _truncate(Path(run.dev_eval_uri(1))), "dev_eval.parquet",
                           ["m-bad", "finished", "2/3", "?", "1/2", "grpo"]),
    "truncated steps": (lambda run: _truncate(Path(run.table_uri(0, "steps"))), "steps table",
                        ["m-bad", "finished", "2/3", "0.500", "?", "grpo"]),
    "config of a list": (lambda run: run.config_path.write_text("- [1]\n"), "config.yaml", NO_CONFIG),
    "config not YAML": (lambda run: run.config_path.write_text("iterations: [\n"), "config.yaml", NO_CONFIG),
    "iterations not a number": (lambda run: run.config_path.write_text("iterations: [1]\nalgorithm: {estimator: grpo}\n"),
                                "config.yaml", ["m-bad", "finished", "2/?", "0.500", "1/2", "grpo"]),
    "config a link to /dev/zero": (lambda run: _link_to_dev_zero(run.config_path), "config.yaml", NO_CONFIG),
    "config an alias bomb": (lambda run: run.config_path.write_text(bomb()), "config.yaml", NO_CONFIG),
    # a damaged end record reads as killed (tests/test_corrupt_resume.py), now with its line
    "status of a list": (lambda run: run.status_path.write_text('{"status": ["x"]}'), "status.json",
                         ["m-bad", "killed", "2/3", "0.500", "1/2", "grpo"]),
    "status a link to /dev/zero": (lambda run: _link_to_dev_zero(run.status_path), "status.json",
                                   ["m-bad", "killed", "2/3", "0.500", "1/2", "grpo"]),
}


def _listed(out: str) -> dict[str, list[str]]:
    """Run id -> its row up to the algorithm; each row's disk column is a size and the last line the total."""
    lines = out.splitlines()
    assert lines[0].split() == HEADER, out
    assert lines[-1].startswith("total: "), out
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert all(SIZE.match(" ".join(row[6:8])) for row in rows.values()), out
    return {run_id: row[:6] for run_id, row in rows.items()}


def _du(*paths: Path) -> int:
    """What `du` says the paths hold together (an inode under two of them counted once)."""
    out = subprocess.run(["du", "-s", "-c", "--block-size=1", *map(str, paths)], capture_output=True, text=True,
                         check=True).stdout
    return int(out.splitlines()[-1].split()[0])


def test_each_run_shows_its_disk_use_counting_hard_links_once_and_the_total_at_the_bottom(root, capsys):
    big = root.run("a-good").iteration_dir(0) / "checkpoint"
    big.mkdir()
    (big / "model.safetensors").write_bytes(os.urandom(3_000_000))
    os.link(big / "model.safetensors", big / "same-inode.safetensors")  # counted once, as du does
    models = root.mlflow_artifacts / "1" / "run" / "artifacts" / "checkpoints" / "iteration=0"
    models.mkdir(parents=True)
    os.link(big / "model.safetensors", models / "model.safetensors")  # a registered version's hard link
    (models / "MLmodel").write_text("flavors: {}\n" * 500)
    assert cli_main(["runs", "--data-root", str(root.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: " ".join(line.split()[6:8]) for line in lines[1:-1]}
    runs = [root.run(run_id).run_dir for run_id in ("a-good", "m-bad", "z-good")]
    assert rows == {run.name: human_bytes(_du(run)) for run in runs}, lines
    assert rows["a-good"].endswith(" MB") and rows["a-good"].startswith("3.")  # 3 MB once, not 6
    beyond = _du(*runs, root.mlflow_artifacts) - _du(*runs)  # the MLmodel: the weights are the run's
    assert 0 < beyond < 100_000
    assert lines[-1] == (f"total: {human_bytes(_du(*runs))} on disk in 3 runs; "
                         f"MLflow artifacts (mlartifacts/): {human_bytes(beyond)} more"), lines


@pytest.mark.parametrize("case", list(DAMAGE))
def test_one_damaged_run_is_one_line_and_the_others_are_listed(root, case, capsys):
    damage, file_named, row = DAMAGE[case]
    damage(root.run("m-bad"))
    code = cli_main(["runs", "--data-root", str(root.path)])
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    assert "Traceback" not in out + err
    listed = _listed(out)
    for good in ("a-good", "z-good"):
        assert listed[good] == [good, "finished", "2/3", "0.500", "1/2", "grpo"], out
    problems = err.strip().splitlines()
    assert len(problems) == 1, err
    assert problems[0].startswith("agentr1: runs: m-bad: ") and file_named in problems[0], err
    assert listed["m-bad"] == row, out  # what could be read of it is still listed


def test_hidden_folders_and_stray_files_are_skipped_silently(root, capsys):
    shutil.copytree(root.run("a-good").run_dir, root.runs_dir / ".ipynb_checkpoints")
    (root.runs_dir / ".ipynb_checkpoints" / "config.yaml").write_text("- [1]\n")
    (root.runs_dir / "notes.txt").write_text("not a run\n")
    assert cli_main(["runs", "--data-root", str(root.path)]) == 0
    out, err = capsys.readouterr()
    assert sorted(_listed(out)) == ["a-good", "m-bad", "z-good"] and err == "", (out, err)


def test_a_folder_that_is_no_run_id_is_named_not_a_crash(root, capsys):
    (root.runs_dir / "my run").mkdir()
    assert cli_main(["runs", "--data-root", str(root.path)]) == 1
    out, err = capsys.readouterr()
    assert sorted(_listed(out)) == ["a-good", "m-bad", "z-good"], out
    assert err.strip().splitlines() == [line for line in err.strip().splitlines() if "'my run'" in line] != [], err


def test_a_truncated_mlflow_store_degrades_to_the_listing_and_one_line(root, capsys):
    with closing(sqlite3.connect(root.mlflow_db)) as db:  # a store with pages to lose, then cut in half
        db.execute("CREATE TABLE experiments (artifact_location TEXT)")
        db.executemany("INSERT INTO experiments VALUES (?)", [(f"/old/mlartifacts/{i}",) for i in range(2000)])
        db.commit()
    _truncate(root.mlflow_db)
    assert cli_main(["runs", "--data-root", str(root.path)]) == 1
    out, err = capsys.readouterr()
    assert sorted(_listed(out)) == ["a-good", "m-bad", "z-good"], out
    problems = err.strip().splitlines()
    assert len(problems) == 1 and "mlflow.db" in problems[0] and "Traceback" not in err, err


def test_control_characters_of_a_recorded_error_are_not_printed_raw(root, capsys):
    record_run_end(root.run("m-bad"), "failed", "boom \x1b[2J\x1b[31mred")
    assert cli_main(["runs", "--data-root", str(root.path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "boom \\x1b[2J" in out, out


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.timeout(60)  # a FIFO read waits for a writer: were it read, the test would hang until here
@pytest.mark.parametrize("make, said", [
    (_link_to_dev_zero, "m-bad: config.yaml not read: a symbolic link (to /dev/zero), not followed"),
    (_fifo, "m-bad: config.yaml not read: not a regular file"),
    (lambda path: path.write_bytes(b"#" * (2 << 20)),
     "m-bad: config.yaml not read: 2,097,152 bytes, more than 1,048,576"),
], ids=["link-to-dev-zero", "fifo", "2-mb"])
def test_a_config_that_is_no_small_regular_file_is_listed_without_reading_it(root, capsys, make, said):
    make(root.run("m-bad").config_path)
    assert cli_main(["runs", "--data-root", str(root.path)]) == 1
    out, err = capsys.readouterr()
    assert _listed(out)["m-bad"] == NO_CONFIG, out
    assert err.strip().splitlines() == [f"agentr1: runs: {said}"], err
