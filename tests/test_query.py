"""DuckDB catalog over real Parquet files written with pyarrow under a temporary data root."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

import schemas
from agent_core.io.layout import RUN_TABLES
from agent_core.io.query import QueryError, format_table, open_catalog, run_query, select_episode_ids, write_result


@dataclass(frozen=True)
class _StandInSpec:
    arrow_schema: pa.Schema


_IDS = [("run_id", pa.string()), ("iteration", pa.int32())]
_STAND_IN = {
    "prompts": pa.schema([*_IDS, ("prompt_id", pa.string()), ("messages", pa.string())]),
    "steps": pa.schema([*_IDS, ("episode_id", pa.string()), ("step_idx", pa.int32()), ("response_ids", pa.list_(pa.int32()))]),
    "rewards": pa.schema([*_IDS, ("episode_id", pa.string()), ("step_idx", pa.int32()), ("reward", pa.float32())]),
    "advantages": pa.schema([*_IDS, ("episode_id", pa.string()), ("advantages", pa.list_(pa.float32()))]),
    "train_metrics": pa.schema([*_IDS, ("step", pa.int32()), ("loss", pa.float64())]),
    "dataset_prompts": pa.schema([("prompt_id", pa.string()), ("question", pa.string())]),
    "corpus": pa.schema([("doc_id", pa.string()), ("text", pa.string())]),
}


@pytest.fixture(autouse=True)
def table_schemas(monkeypatch) -> dict[str, pa.Schema]:
    """The real `schemas.TABLES` where it exists; a minimal stand-in until schemas/ lands."""
    real = getattr(schemas, "TABLES", None)
    if real:
        return {name: spec.arrow_schema for name, spec in real.items()}
    monkeypatch.setattr(schemas, "TABLES", {n: _StandInSpec(s) for n, s in _STAND_IN.items()}, raising=False)
    return dict(_STAND_IN)


def _steps(run_id: str, iteration: int, rows: int) -> pa.Table:
    return pa.table(
        {
            "run_id": pa.array([run_id] * rows, pa.string()),
            "iteration": pa.array([iteration] * rows, pa.int32()),
            "episode_id": [f"{run_id}-e{i}" for i in range(rows)],
            "step_idx": pa.array(range(rows), pa.int32()),
            "response_ids": pa.array([[1, 2, i] for i in range(rows)], pa.list_(pa.int32())),
        }
    )


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    """Two runs x two iterations of `steps` (row counts 1..4), one train_metrics file, one dataset,
    and hidden files that must never be read."""
    counts = {("r1", 0): 1, ("r1", 1): 2, ("r2", 0): 3, ("r2", 1): 4}
    for (run_id, iteration), rows in counts.items():
        folder = tmp_path / "runs" / run_id / f"iteration={iteration}"
        folder.mkdir(parents=True)
        pq.write_table(_steps(run_id, iteration, rows), folder / "steps.parquet")
    metrics = pa.table({"run_id": ["r1"], "iteration": pa.array([0], pa.int32()), "step": pa.array([0], pa.int32()), "loss": [0.5]})
    pq.write_table(metrics, tmp_path / "runs" / "r1" / "iteration=0" / "train_metrics.parquet")
    # A writer's half-written temp file, and a run folder still being created: both hidden.
    pq.write_table(_steps("r1", 0, 100), tmp_path / "runs" / "r1" / "iteration=0" / ".steps.tmp.parquet")
    hidden_run = tmp_path / "runs" / ".r3" / "iteration=0"
    hidden_run.mkdir(parents=True)
    pq.write_table(_steps("r3", 0, 100), hidden_run / "steps.parquet")
    dataset = tmp_path / "datasets" / "toy"
    dataset.mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": ["p0", "p1"], "question": ["a?", "b?"]}), dataset / "prompts.parquet")
    return tmp_path


def test_counts_per_run_and_iteration_across_all_files(data_root: Path):
    result = run_query(
        data_root, "SELECT run_id, iteration, count(*) AS n FROM steps GROUP BY ALL ORDER BY run_id, iteration"
    )
    assert result.to_pylist() == [
        {"run_id": "r1", "iteration": 0, "n": 1},
        {"run_id": "r1", "iteration": 1, "n": 2},
        {"run_id": "r2", "iteration": 0, "n": 3},
        {"run_id": "r2", "iteration": 1, "n": 4},
    ]


def test_hidden_temp_files_and_hidden_folders_are_never_read(data_root: Path):
    assert run_query(data_root, "SELECT count(*) AS n FROM steps").to_pylist() == [{"n": 10}]
    assert run_query(data_root, "SELECT count(*) AS n FROM steps WHERE run_id = 'r3'").to_pylist() == [{"n": 0}]


def test_run_id_and_iteration_keep_the_table_own_types(data_root: Path):
    # Hive partitioning would replace `iteration` by the folder's value typed BIGINT (int64).
    result = run_query(data_root, "SELECT run_id, iteration, response_ids FROM steps LIMIT 1")
    assert result.schema.field("run_id").type == pa.string()
    assert result.schema.field("iteration").type == pa.int32()
    assert result.schema.field("response_ids").type == pa.list_(pa.int32())
    assert result.column_names == ["run_id", "iteration", "response_ids"]


def test_tables_without_files_are_empty_views_with_schema_columns(data_root: Path, table_schemas):
    with open_catalog(data_root) as catalog:
        assert set(RUN_TABLES) <= set(catalog.views())
        for name in ("rewards", "advantages", "prompts"):
            result = catalog.select(f"SELECT * FROM {name}")
            expected = table_schemas[name]
            assert result.num_rows == 0
            assert result.column_names == expected.names
            assert result.schema.field("iteration").type == expected.field("iteration").type
        joined = catalog.select("SELECT count(*) AS n FROM steps JOIN rewards USING (run_id, iteration)")
        assert joined.to_pylist() == [{"n": 0}]


def test_dataset_tables_are_views_too(data_root: Path, table_schemas):
    assert run_query(data_root, "SELECT prompt_id FROM dataset_prompts ORDER BY 1").to_pylist() == [
        {"prompt_id": "p0"},
        {"prompt_id": "p1"},
    ]
    if "corpus" in table_schemas:
        assert run_query(data_root, "SELECT count(*) AS n FROM corpus").to_pylist() == [{"n": 0}]


def test_an_empty_data_root_still_answers_queries(tmp_path: Path):
    assert run_query(tmp_path, "SELECT count(*) AS n FROM steps").to_pylist() == [{"n": 0}]


def test_sql_errors_carry_duckdb_message_and_the_views(data_root: Path):
    with pytest.raises(QueryError) as caught:
        run_query(data_root, "SELECT * FROM stepz")
    message = str(caught.value)
    assert "stepz" in message
    assert "available views:" in message
    for name in (*RUN_TABLES, "dataset_prompts"):
        assert name in caught.value.views and name in message
    assert isinstance(caught.value, ValueError)
    assert "\n" not in message and "LINE 1" not in message  # one line, without DuckDB's caret under the query


def test_format_table_aligns_columns_and_counts_rows():
    table = pa.table({"run_id": ["r1", "run-22"], "n": pa.array([3, 12345], pa.int64()), "loss": [0.5, None]})
    lines = format_table(table).splitlines()
    assert lines[0] == "run_id      n  loss"
    assert lines[1] == "------  -----  ----"
    assert lines[2] == "r1          3   0.5"
    assert lines[3] == "run-22  12345  NULL"
    assert lines[4] == "(2 rows)"
    assert format_table(table, max_rows=1).splitlines()[-1] == "(1 of 2 rows shown)"


def test_format_table_cuts_long_cells_and_flattens_newlines():
    text = format_table(pa.table({"text": ["line one\nline two " + "x" * 80]}))
    cell = text.splitlines()[2]
    assert len(cell) == 40 and cell.endswith("...") and "\\n" in cell


def test_write_result_csv_and_parquet_round_trip(data_root: Path, tmp_path: Path):
    result = run_query(data_root, "SELECT run_id, iteration, response_ids FROM steps ORDER BY run_id, iteration, step_idx")
    parquet_path = tmp_path / "out" / "result.parquet"
    write_result(result, parquet_path)
    assert pq.read_table(parquet_path).equals(result)

    csv_path = tmp_path / "out" / "result.csv"
    write_result(result, csv_path)
    back = pa_csv.read_csv(csv_path)
    assert back.num_rows == 10
    assert back.column("run_id").to_pylist()[:2] == ["r1", "r1"]
    assert back.column("response_ids").to_pylist()[0] == "[1, 2, 0]"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["result.csv", "result.parquet"]


def test_write_result_refuses_unknown_suffix(tmp_path: Path):
    with pytest.raises(ValueError, match=r"result\.json.*'\.json'.*\.csv, \.parquet"):
        write_result(pa.table({"a": [1]}), tmp_path / "result.json")


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"not parquet at all " * 20)


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_table_file_is_named_with_its_view_and_other_views_still_answer(data_root: Path, how: str):
    bad = data_root / "runs" / "r2" / "iteration=1" / "steps.parquet"
    _damage(bad, how)
    for sql in ("SELECT count(*) FROM steps", "SELECT episode_id FROM steps WHERE step_idx = 1 LIMIT 0",
                "SELECT * FROM query_table('steps')"):
        with pytest.raises(QueryError) as caught:
            run_query(data_root, sql)
        message = str(caught.value)
        # the real file, not the snapshot's hard link the view read
        assert message.startswith("view steps: ") and f"'{bad}'" in message, message
        assert ".query-" not in message and "\n" not in message
    assert run_query(data_root, "SELECT count(*) AS n FROM train_metrics").to_pylist() == [{"n": 1}]
    prompts = run_query(data_root, "SELECT prompt_id FROM dataset_prompts ORDER BY 1")
    assert prompts.column("prompt_id").to_pylist() == ["p0", "p1"]
    assert not list(data_root.glob(".query-*"))  # the snapshot folder went with the query


def test_a_file_damaged_after_the_catalog_opened_is_named_too(data_root: Path, tmp_path: Path):
    bad = data_root / "runs" / "r1" / "iteration=1" / "steps.parquet"
    snapshot = data_root / ".query-test"
    with open_catalog(data_root, snapshot) as catalog:
        assert catalog.select("SELECT count(*) AS n FROM steps").to_pylist() == [{"n": 10}]
        with open(bad, "r+b") as handle:  # in place: the snapshot's hard link sees it too
            handle.truncate(bad.stat().st_size // 2)
        with pytest.raises(QueryError, match=r"^view steps: .*" + re.escape(f"'{bad}'")) as caught:
            catalog.select("SELECT count(*) AS n FROM steps")
        assert str(snapshot) not in str(caught.value)
        assert catalog.select("SELECT count(*) AS n FROM train_metrics").to_pylist() == [{"n": 1}]


def test_a_damaged_file_is_named_without_a_snapshot_too(data_root: Path):
    bad = data_root / "runs" / "r1" / "iteration=0" / "train_metrics.parquet"
    _damage(bad, "garbage")
    with open_catalog(data_root) as catalog:  # a read-only data root: the views read the files themselves
        with pytest.raises(QueryError, match=r"^view train_metrics: .*" + re.escape(f"'{bad}'")):
            catalog.select("SELECT * FROM train_metrics")
        assert catalog.select("SELECT count(*) AS n FROM steps").to_pylist() == [{"n": 10}]


def test_select_episode_ids_names_a_damaged_table(tmp_path: Path):
    steps, rewards = tmp_path / "steps.parquet", tmp_path / "rewards.parquet"
    pq.write_table(_steps("r1", 0, 2), steps)
    pq.write_table(pa.table({"episode_id": ["r1-e0"], "em": [1.0]}), rewards)
    tables = {"steps": str(steps), "rewards": str(rewards)}
    assert select_episode_ids("SELECT episode_id FROM rewards WHERE em = 1", tables) == ["r1-e0"]
    assert select_episode_ids("SELECT episode_id FROM steps ORDER BY 1", tables) == ["r1-e0", "r1-e1"]
    _damage(rewards, "truncated")
    with pytest.raises(QueryError, match=r"^view rewards: .*" + re.escape(f"'{rewards}'")):
        select_episode_ids("SELECT episode_id FROM rewards WHERE em = 1", tables)
    assert select_episode_ids("SELECT episode_id FROM steps ORDER BY 1", tables) == ["r1-e0", "r1-e1"]
