"""Concurrency (issue 7): one writer per run, any number of runs per data root, readers that only
ever see complete tables."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_core.io.layout import DataRoot
from agent_core.io.locks import RunInUseError, run_lock, sweep_temporaries
from agent_core.io.query import run_query
from agent_core.io.tables import write_table
from kill_harness import registered_iterations, run_cli, train_args, visible_problems
from test_schemas import steps_rows


def _episodes(count: int, iteration: int) -> list[dict]:
    """`count` three-step episodes (the schema tests' first episode, renumbered)."""
    template = [row for row in steps_rows() if row["episode_id"] == "ep-0"]
    return [dict(row, episode_id=f"ep-{e}", sample_idx=e, iteration=iteration) for e in range(count) for row in template]


def test_a_second_writer_of_the_same_run_is_refused_naming_the_first(tmp_path):
    lock = tmp_path / "runs" / "r1" / ".lock"
    with run_lock(lock, "r1"):
        with pytest.raises(RunInUseError, match=r"run 'r1' is being written by another process \(pid \d+"):
            with run_lock(lock, "r1"):
                pass
        with run_lock(tmp_path / "runs" / "r2" / ".lock", "r2"):  # another run of the same root: fine
            pass
    with run_lock(lock, "r1"):  # released when the holder's block ends
        pass


def test_sweep_removes_only_what_killed_writers_leave(tmp_path):
    leftovers = [tmp_path / "iteration=0" / ".steps.parquet.k2j4h1x_.tmp", tmp_path / "iteration=0" / ".optimizer.pt.tmp-0a1b2c3d",
                 tmp_path / "_manifests" / ".rollout.json.abc.tmp"]
    keep = [tmp_path / "iteration=0" / "steps.parquet", tmp_path / ".lock", tmp_path / "config.yaml"]
    for path in leftovers + keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    staged = tmp_path / "iteration=0" / ".checkpoint.tmp-0123abcd"
    staged.mkdir()
    (staged / "model.safetensors").write_text("half")
    removed = sweep_temporaries(tmp_path)
    assert sorted(removed) == sorted(leftovers + [staged])
    assert all(p.exists() for p in keep) and not any(p.exists() for p in leftovers + [staged])


def test_queries_see_only_complete_tables_while_a_writer_replaces_them(tmp_path):
    """A writer keeps replacing two iterations' steps tables with versions of different sizes; SQL
    over the data root, at the same time, must always see whole versions (every file's row count
    is one that was written) and never fail."""
    run = DataRoot(tmp_path).run("live")
    sizes = (1, 2, 3, 4)  # episodes per version: 3 steps each
    stop = threading.Event()

    def writer() -> int:
        versions = 0
        while not stop.is_set():
            for k in (0, 1):
                write_table("steps", _episodes(sizes[versions % len(sizes)], k), run.table_uri(k, "steps"))
            versions += 1
        return versions

    write_table("steps", _episodes(1, 0), run.table_uri(0, "steps"))
    with ThreadPoolExecutor(1) as pool:
        written = pool.submit(writer)
        queries, deadline = 0, time.monotonic() + 8
        try:
            while time.monotonic() < deadline and queries < 200:
                result = run_query(tmp_path, "select iteration, count(*) as n, count(distinct episode_id) as e, "
                                             "sum(done::int) as finals from steps group by 1")
                for n, episodes, finals in zip(*(result.column(c).to_pylist() for c in ("n", "e", "finals"))):
                    assert n == 3 * episodes and finals == episodes, (n, episodes, finals)
                queries += 1
        finally:
            stop.set()
        assert written.result() > 3  # the writer really replaced the tables during the queries


@pytest.mark.slow
def test_two_runs_write_the_same_data_root_at_once(tmp_path):
    """Two `agentr1 train` processes on one data root (shared dataset, Prefect home and MLflow
    store) run side by side, while SQL reads the root; both finish with valid tables."""
    data_root = tmp_path / "shared"
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_cli, train_args(run_id), data_root) for run_id in ("left", "right")]
        queries = 0
        while not all(r.done() for r in runs):
            if (data_root / "runs").is_dir():
                run_query(data_root, "select run_id, iteration, count(*) from steps group by 1, 2")
                queries += 1
            time.sleep(0.5)
        results = [r.result() for r in runs]
    assert [code for code, _ in results] == [0, 0], [output[-3000:] for _, output in results]
    for run_id in ("left", "right"):
        assert visible_problems(data_root, run_id) == []
    table = run_query(data_root, "select run_id, count(distinct iteration) as k from train_metrics group by 1 order by 1")
    assert table.to_pylist() == [{"run_id": "left", "k": 2}, {"run_id": "right", "k": 2}]
    assert registered_iterations(data_root) == [1, 1]  # each run's retention kept its newest, and only its own
    assert queries > 0
