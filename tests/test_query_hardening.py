"""`agentr1 query` against an untrusted data root and a user who wants it stopped (issue 39, items 3-6).

Each case is driven as the attacker drove it: real files planted in a data root (a stray
`costs.parquet`, a symlink out of the root, a secret in the current folder's `.tmp/`), the real
CLI (`flows.cli.main`, or a subprocess that gets a real SIGINT or SIGKILL), and `--output` aimed at
another data root's tables.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import schemas
from flows.cli import main as cli_main
from test_schemas import SAMPLES

ENDLESS = "select count(*) from range(10000000000000)"  # minutes of work, no memory: ran 10 min past Ctrl-C


def _write(name: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(schemas.table_from_rows(name, SAMPLES[name]()), path)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A data root with run r1's steps and rewards at iteration 0 and a dataset's prompts."""
    data = tmp_path / "data"
    for name in ("steps", "rewards"):
        _write(name, data / "runs" / "r1" / "iteration=0" / f"{name}.parquet")
    _write("dataset_prompts", data / "datasets" / "toy" / "prompts.parquet")
    return data


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """Files beside the data root that no query may read."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.txt").write_text("planted secret\n")
    pq.write_table(pa.table({"secret": ["planted secret"]}), folder / "secret.parquet")
    return folder


def query(root: Path, sql: str, *options: str, capsys) -> tuple[int, str, list[str]]:
    """`agentr1 query` in process: exit code, stdout, stderr's lines."""
    code = cli_main(["query", "--data-root", str(root), *options, sql])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.splitlines()


def _snapshots(root: Path) -> list[Path]:
    return sorted(root.glob(".query-*"))


# ---- item 3: a stray file in a run --------------------------------------------------------------

@pytest.mark.parametrize("where", ["runs/r1/iteration=0/costs.parquet", "runs/r1/iteration=0/step_costs.parquet",
                                   "runs/r1/iteration=0/eval.parquet", "runs/r1/iteration=0/notes.parquet",
                                   "runs/r1/costs.parquet"])
def test_a_stray_file_in_a_run_is_ignored_with_one_warning_naming_it(root: Path, where: str, capsys):
    stray = root / where
    stray.write_bytes((root / "runs/r1/iteration=0/steps.parquet").read_bytes())  # a valid table, wrong name
    code, out, err = query(root, "select count(*) as n from steps", capsys=capsys)
    assert code == 0, err
    assert "(1 row)" in out
    assert len(err) == 1 and "warning" in err[0] and str(stray) in err[0], err
    code, out, err = query(root, "select * from step_costs", capsys=capsys)  # the derived views still answer
    assert code == 0 and len(err) == 1, err


def test_a_garbage_file_with_a_view_name_does_not_stop_the_other_views(root: Path, capsys):
    (root / "runs/r1/iteration=0/costs.parquet").write_bytes(b"not parquet")
    code, out, err = query(root, "select count(*) as n from rewards", capsys=capsys)
    assert code == 0 and len(err) == 1 and "costs.parquet" in err[0], err


# ---- item 4: Ctrl-C, --timeout, the memory limit, a killed query's leftovers --------------------

def _start(root: Path, sql: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "query", "--data-root", str(root), sql], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_running(process: subprocess.Popen, root: Path) -> Path:
    """The query's snapshot folder, once it exists (the catalog is then opening); at most 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        mine = [p for p in _snapshots(root) if f"-{process.pid}-" in p.name or p.name.count("-") == 1]
        if mine:
            time.sleep(1.0)  # into the query itself
            return mine[0]
        time.sleep(0.05)
    raise AssertionError(f"the query never started: {process.communicate(timeout=5)}")


def _finish(process: subprocess.Popen, seconds: float = 30) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"still running {seconds} s after the signal: {err[-500:]}") from None
    return process.returncode, out, err


def test_ctrl_c_interrupts_a_running_query_with_exit_130_and_one_line(root: Path, tmp_path: Path):
    process = _start(root, ENDLESS, tmp_path)
    try:
        _wait_running(process, root)
        process.send_signal(signal.SIGINT)
        code, out, err = _finish(process)
    finally:
        process.kill()
    assert code == 130, err
    assert len(err.splitlines()) == 1 and "interrupted" in err, err
    assert _snapshots(root) == []


def test_timeout_interrupts_the_query_in_one_line(root: Path, capsys):
    started = time.monotonic()
    code, out, err = query(root, ENDLESS, "--timeout", "1", capsys=capsys)
    assert code != 0 and time.monotonic() - started < 15
    assert len(err) == 1 and "timed out after 1 s" in err[0] and "--timeout" in err[0], err
    assert _snapshots(root) == []


def test_the_memory_limit_defaults_to_a_quarter_of_ram_and_is_settable(root: Path, capsys):
    code, out, err = query(root, "select current_setting('memory_limit') as m", capsys=capsys)
    assert code == 0, err
    quarter_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4 / 2**30
    shown = float(out.splitlines()[2].split()[0])  # e.g. "5.8 GiB"
    assert "GiB" in out and shown <= quarter_gib + 0.1, out
    code, out, err = query(root, "select current_setting('memory_limit') as m", "--memory-limit", "64MB",
                           capsys=capsys)
    assert code == 0 and "61.0 MiB" in out, (out, err)


def test_a_query_past_the_memory_limit_fails_in_one_line(root: Path, capsys):
    sql = "select length(string_agg(repeat('x', 100), ',')) from range(2000000)"  # a 200 MB string
    code, out, err = query(root, sql, "--memory-limit", "64MB", capsys=capsys)
    assert code == 2 and len(err) == 1 and "Out of Memory" in err[0] and "--memory-limit" in err[0], err


@pytest.mark.parametrize("value", ["abc", "-1", "4 parsecs", "0.5"])
def test_a_bad_memory_limit_or_timeout_is_refused_in_one_line(root: Path, value: str, capsys):
    code, out, err = query(root, "select 1", "--memory-limit", value, capsys=capsys)
    assert code == 2 and len(err) == 1 and "--memory-limit" in err[0], err
    if value != "0.5":
        code, out, err = query(root, "select 1", "--timeout", value, capsys=capsys)
        assert code == 2 and len(err) == 1 and "--timeout" in err[0], err


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_killed_query_s_leftovers_are_cleaned_at_the_next_start_but_not_a_live_one_s(root: Path, capsys):
    host = socket.gethostname()
    dead = root / f".query-{host}-{_dead_pid()}-abc"
    live = root / f".query-{host}-{os.getpid()}-def"  # this test's own process: alive
    elsewhere = root / f".query-otherhost-{_dead_pid()}-ghi"  # another machine's: its pid says nothing here
    old, fresh = root / ".query-0ld", root / ".query-fr3sh"  # an earlier version's, without a pid
    for folder in (dead, live, elsewhere, old, fresh):
        (folder / "steps").mkdir(parents=True)
        os.link(root / "runs/r1/iteration=0/steps.parquet", folder / "steps" / "0.parquet")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    code, out, err = query(root, "select count(*) as n from steps", capsys=capsys)
    assert code == 0, err
    assert _snapshots(root) == sorted([live, elsewhere, fresh])


@pytest.mark.slow
def test_a_sigkilled_query_is_cleaned_by_the_next_while_a_concurrent_one_is_left_alone(root: Path, tmp_path: Path,
                                                                                        capsys):
    killed = _start(root, ENDLESS, tmp_path)
    try:
        leftover = _wait_running(killed, root)
    finally:
        killed.kill()
        killed.wait()
    assert leftover.exists()
    live = _start(root, ENDLESS, tmp_path)
    try:
        live_folder = _wait_running(live, root)
        assert not leftover.exists()  # removed at the next query's start
        code, out, err = query(root, "select count(*) as n from steps", capsys=capsys)
        assert code == 0, err
        assert _snapshots(root) == [live_folder]
        live.send_signal(signal.SIGINT)
        assert _finish(live)[0] == 130
    finally:
        live.kill()
    assert _snapshots(root) == []


# ---- item 5: files outside the root -------------------------------------------------------------

def test_the_current_folder_s_tmp_is_not_readable_and_duckdb_s_temp_folder_is_private(
        root: Path, tmp_path: Path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    (cwd / ".tmp").mkdir(parents=True)
    (cwd / ".tmp" / "secret.txt").write_text("planted secret\n")
    monkeypatch.chdir(cwd)
    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_temp))
    for sql in ("select content from read_text('.tmp/**')", f"select content from read_text('{cwd}/.tmp/secret.txt')"):
        code, out, err = query(root, sql, capsys=capsys)
        assert code == 2 and len(err) == 1 and "Permission Error" in err[0], err
        assert "planted secret" not in out + "".join(err)
    code, out, err = query(root, f"select current_setting('temp_directory') like '{system_temp}/%' as private",
                           capsys=capsys)
    assert code == 0 and out.splitlines()[2].strip() == "True", out
    assert list(system_temp.iterdir()) == []  # removed on exit


def test_a_symlink_out_of_the_root_is_not_followed(root: Path, outside: Path, tmp_path: Path, capsys):
    iteration = root / "runs" / "r1" / "iteration=0"
    (iteration / "health.parquet").symlink_to(outside / "secret.txt")
    (iteration / "train_metrics.parquet").symlink_to(outside / "secret.parquet")
    foreign_run = tmp_path / "foreign" / "iteration=0"
    _write("steps", foreign_run / "steps.parquet")
    (root / "runs" / "r9").symlink_to(foreign_run.parent)
    (root / "runs" / "r1" / "iteration=1").mkdir()
    (root / "runs" / "r1" / "iteration=1" / "rewards.parquet").symlink_to(iteration / "rewards.parquet")  # inside
    for sql in (f"select content from read_text('{outside / 'secret.txt'}')",
                f"select * from read_parquet('{outside / 'secret.parquet'}')"):
        code, out, err = query(root, sql, capsys=capsys)
        assert code == 2 and "planted secret" not in out + "\n".join(err), (out, err)
        assert "Permission Error" in err[-1]
    code, out, err = query(root, "select (select count(*) from steps) as s, (select count(*) from train_metrics) as t, "
                                 "(select count(*) from rewards) as r", capsys=capsys)
    assert code == 0, err
    steps, metrics, rewards = (int(v) for v in out.splitlines()[2].split())
    assert (steps, metrics) == (len(SAMPLES["steps"]()), 0) and rewards == 2 * len(SAMPLES["rewards"]())
    assert len(err) == 3 and all("warning" in line and "symlink" in line for line in err), err


# ---- item 6: --output ---------------------------------------------------------------------------

def test_output_refuses_to_overwrite_a_file_without_force(root: Path, tmp_path: Path, capsys):
    target = tmp_path / "result.csv"
    target.write_text("precious\n")
    code, out, err = query(root, "select 1 as x", "--output", str(target), capsys=capsys)
    assert code == 2 and len(err) == 1 and "--force" in err[0] and target.read_text() == "precious\n", err
    code, out, err = query(root, "select 1 as x", "--output", str(target), "--force", capsys=capsys)
    assert code == 0 and target.read_text().splitlines() == ['"x"', "1"], (err, target.read_text())


@pytest.mark.parametrize("where", ["runs/r1/iteration=0/steps.parquet", "runs/r1/iteration=0/new.parquet",
                                   "runs/r2/iteration=3/steps.parquet", "datasets/toy/prompts.parquet",
                                   "evals/e1/agent/seed=0/eval.parquet", "through-a-link/steps.parquet"])
def test_output_refuses_any_data_root_s_tables_not_only_the_one_queried(root: Path, tmp_path: Path, where: str,
                                                                         capsys):
    other = tmp_path / "other"
    _write("steps", other / "runs" / "r1" / "iteration=0" / "steps.parquet")
    _write("dataset_prompts", other / "datasets" / "toy" / "prompts.parquet")
    (other / "through-a-link").symlink_to(other / "runs" / "r1" / "iteration=0")
    before = {p: p.read_bytes() for p in other.rglob("*.parquet")}
    code, out, err = query(root, "select 1 as x", "--output", str(other / where), "--force", capsys=capsys)
    assert code == 2 and len(err) == 1 and "among the tables" in err[0], err
    assert {p: p.read_bytes() for p in other.rglob("*.parquet")} == before


def test_output_refuses_the_tables_of_a_root_known_by_its_mlflow_db(root: Path, tmp_path: Path, capsys):
    other = tmp_path / "fresh"
    other.mkdir()
    (other / "mlflow.db").write_bytes(b"")
    code, out, err = query(root, "select 1 as x", "--output", str(other / "runs" / "x.parquet"), capsys=capsys)
    assert code == 2 and len(err) == 1 and "among the tables" in err[0], err
    code, out, err = query(root, "select 1 as x", "--output", str(other / "x.parquet"), capsys=capsys)
    assert code == 0, err  # beside the tables is fine


def test_output_to_a_directory_or_an_unwritable_place_is_one_line(root: Path, tmp_path: Path, capsys):
    (tmp_path / "folder.csv").mkdir()
    (tmp_path / "a-file").write_text("x")
    for target in (tmp_path / "folder.csv", tmp_path / "a-file" / "r.csv", Path("/proc/r.csv"), Path("/sys/r.csv")):
        code, out, err = query(root, "select 1 as x", "--output", str(target), "--force", capsys=capsys)
        assert code == 2 and len(err) == 1 and str(target) in err[0], (target, err)
