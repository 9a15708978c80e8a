"""Hostile SQL (issue 29): every SQL run on a user's behalf (`agentr1 query`, `warm_start.select_sql`) is
one SELECT on a DuckDB connection that can read only the views' files. Each attack below worked
against the unrestricted connection (a COPY overwrote a run's steps table, PARTITION_BY OVERWRITE
deleted files, ATTACH created one, read_text/glob read any file, INSTALL went to the network); here
each must be refused in one line, with every byte of the data root, the current folder and the
files around it unchanged.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from agent_core.config_errors import ConfigError
from agent_core.io.query import QueryError, run_query, select_episode_ids
from agent_core.io.tables import write_table
from agent_core.validation import build_config
from flows.cli import main as cli_main
from test_schemas import SAMPLES

RUN_TABLES = ("prompts", "steps", "rewards", "advantages", "train_metrics")


def _tree(*folders: Path) -> dict[str, str]:
    """Every file under `folders` (hidden ones included) -> sha256 of its bytes."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A data root with real tables (run r1, iterations 0 and 1; a dataset) and a hidden file inside
    it that no view reads; written once (validating tables is the slow part), copied per test."""
    root = tmp_path_factory.mktemp("template") / "data"
    for iteration in (0, 1):
        folder = root / "runs" / "r1" / f"iteration={iteration}"
        for name in RUN_TABLES:
            write_table(name, [{**row, "iteration": iteration} for row in SAMPLES[name]()], folder / f"{name}.parquet")
    for name, file_name in (("dataset_prompts", "prompts"), ("corpus", "corpus")):
        write_table(name, SAMPLES[name](), root / "datasets" / "toy" / f"{file_name}.parquet")
    pq.write_table(pa.table({"secret": ["hidden-in-root"]}), root / "runs" / "r1" / "iteration=0" / ".secret.parquet")
    return root


@pytest.fixture
def world(template: Path, tmp_path: Path, monkeypatch) -> dict[str, Path]:
    """The template's data root, files outside it a query must not read, and an empty current folder."""
    root = tmp_path / "data"
    shutil.copytree(template, root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("top secret\n")
    pa_csv.write_csv(pa.table({"secret": ["top secret"]}), outside / "secret.csv")
    pq.write_table(pa.table({"secret": ["top secret"]}), outside / "secret.parquet")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return {"root": root, "outside": outside, "cwd": cwd, "tmp": tmp_path}


def _attacks(root: Path, outside: Path) -> dict[str, str]:
    steps = root / "runs" / "r1" / "iteration=1" / "steps.parquet"
    return {
        "copy_over_a_table": f"COPY (SELECT 42 AS x) TO '{steps}' (FORMAT parquet)",
        "copy_partition_overwrite": f"COPY (SELECT 1 AS x, 2 AS y) TO '{steps.parent}' "
                                    "(FORMAT parquet, PARTITION_BY (x), OVERWRITE)",
        "copy_relative_into_cwd": "COPY (SELECT 1 AS x) TO 'out.csv'",
        "attach": f"ATTACH '{root / 'evil.db'}' AS evil",
        "export_database": f"EXPORT DATABASE '{root / 'export'}'",
        "create_table": "CREATE TABLE t AS SELECT 1 AS x",
        "create_view_over_a_file": f"CREATE VIEW v AS SELECT * FROM read_text('{outside / 'secret.txt'}')",
        "install": "INSTALL httpfs",
        "load": "LOAD httpfs",
        "set": "SET enable_external_access = true",
        "set_variable": "SET VARIABLE agentr1_view_steps = 'SELECT 1'",
        "reset_lock": "RESET lock_configuration",
        "unlock": "SET lock_configuration = false",
        "pragma": "PRAGMA enable_profiling",
        "call": "CALL pragma_version()",
        "two_selects": "SELECT 1; SELECT 2",
        "select_then_copy": f"SELECT 1; COPY (SELECT 42 AS x) TO '{steps}' (FORMAT parquet)",
        "set_inside_query": "SELECT * FROM query('SET enable_external_access = true')",
        "read_text_outside": f"SELECT * FROM read_text('{outside / 'secret.txt'}')",
        "read_blob_outside": f"SELECT * FROM read_blob('{outside / 'secret.txt'}')",
        "read_csv_outside": f"SELECT * FROM read_csv('{outside / 'secret.csv'}')",
        "read_csv_etc_passwd": "SELECT * FROM read_csv('/etc/passwd')",
        "read_parquet_outside": f"SELECT * FROM read_parquet('{outside / 'secret.parquet'}')",
        "file_path_as_table": f"SELECT * FROM '{outside / 'secret.csv'}'",
        "parquet_metadata_outside": f"SELECT * FROM parquet_metadata('{outside / 'secret.parquet'}')",
        "hidden_file_in_root": f"SELECT * FROM read_parquet('{root / 'runs/r1/iteration=0/.secret.parquet'}')",
        "glob_outside": f"SELECT * FROM glob('{outside}/*')",
        "glob_root_folder": "SELECT * FROM glob('/root/*')",
        "glob_data_root": f"SELECT * FROM glob('{root}/**')",
        "http": "SELECT * FROM read_csv('https://example.com/x.csv')",
    }


ATTACKS = sorted(_attacks(Path("/r"), Path("/o")))


@pytest.mark.parametrize("attack", ATTACKS)
def test_each_attack_is_refused_in_one_line_and_changes_nothing(world, attack):
    sql = _attacks(world["root"], world["outside"])[attack]
    before = _tree(world["tmp"])
    with pytest.raises(QueryError) as caught:
        run_query(world["root"], sql)
    message = str(caught.value)
    assert "\n" not in message and message.strip() == message
    assert "top secret" not in message and "hidden-in-root" not in message
    assert _tree(world["tmp"]) == before  # data root, outside files, current folder: same files, same bytes


@pytest.mark.parametrize("attack", ATTACKS)
def test_each_attack_through_the_cli_exits_2_with_one_line(world, attack, capsys):
    sql = _attacks(world["root"], world["outside"])[attack]
    before = _tree(world["tmp"])
    assert cli_main(["query", "--data-root", str(world["root"]), sql]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("agentr1: error: ") and captured.err.count("\n") == 1
    assert _tree(world["tmp"]) == before


def test_statements_are_refused_by_type_before_anything_runs(world):
    with pytest.raises(QueryError, match=r"^refused a statement of type COPY: only a single SELECT"):
        run_query(world["root"], _attacks(world["root"], world["outside"])["copy_over_a_table"])
    with pytest.raises(QueryError, match=r"^expected one SQL statement, got 2"):
        run_query(world["root"], "SELECT 1; SELECT 2")
    with pytest.raises(QueryError, match=r"^refused a statement of type SET"):
        run_query(world["root"], "RESET lock_configuration")


def test_file_access_inside_a_select_is_refused_by_duckdb(world):
    with pytest.raises(QueryError, match=r"Permission Error: .*secret\.txt.*reads only the data root's tables"):
        run_query(world["root"], f"SELECT * FROM read_text('{world['outside'] / 'secret.txt'}')")


def test_ordinary_selects_still_answer(world):
    root = world["root"]
    assert run_query(root, "SELECT iteration, count(*) AS n FROM steps GROUP BY 1 ORDER BY 1").to_pylist() == [
        {"iteration": 0, "n": 6}, {"iteration": 1, "n": 6}]
    assert run_query(root, "WITH e AS (SELECT DISTINCT episode_id FROM rewards WHERE em = 1) "
                           "SELECT count(*) AS n FROM e").to_pylist() == [{"n": 2}]
    assert run_query(root, "FROM corpus SELECT count(*) AS n").to_pylist() == [{"n": 3}]
    assert run_query(root, "DESCRIBE steps").num_rows > 0
    assert run_query(root, "SELECT 1 AS one;").to_pylist() == [{"one": 1}]  # a trailing ';' is still one statement


def test_output_is_written_by_our_code_where_the_user_says(world, capsys):
    result = world["tmp"] / "results" / "episodes.csv"
    assert cli_main(["query", "--data-root", str(world["root"]), "--output", str(result),
                     "SELECT DISTINCT episode_id FROM steps ORDER BY 1"]) == 0
    assert pa_csv.read_csv(result).column("episode_id").to_pylist() == ["ep-0", "ep-1"]
    assert capsys.readouterr().out == f"agentr1: wrote 2 rows to {result}\n"


@pytest.mark.parametrize("target", ["runs/r1/iteration=1/steps.parquet", "runs/r1/iteration=1/new_view.parquet",
                                    "datasets/toy/corpus.parquet", "evals/e/agent/seed=0/eval.parquet"])
def test_output_never_lands_among_the_tables(world, target, capsys):
    before = _tree(world["tmp"])
    path = world["root"] / target
    assert cli_main(["query", "--data-root", str(world["root"]), "--output", str(path), "SELECT 42 AS x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentr1: error: refusing to write a result to") and err.count("\n") == 1
    assert _tree(world["tmp"]) == before


# ---- warm_start.select_sql: the same function, and refused at config check -----------------------------------


def _selection_tables(world) -> dict[str, str]:
    folder = world["root"] / "runs" / "r1" / "iteration=0"
    return {"steps": str(folder / "steps.parquet"), "rewards": str(folder / "rewards.parquet")}


def test_select_sql_runs_read_only(world):
    tables = _selection_tables(world)
    assert select_episode_ids("select episode_id from rewards where em = 1 order by 1", tables) == ["ep-0", "ep-1"]
    before = _tree(world["tmp"])
    for sql in (f"COPY (SELECT 'x' AS episode_id) TO '{tables['steps']}' (FORMAT parquet)",
                f"SELECT content AS episode_id FROM read_text('{world['outside'] / 'secret.txt'}')",
                "SELECT episode_id FROM rewards; SELECT 1"):
        with pytest.raises(QueryError) as caught:
            select_episode_ids(sql, tables)
        assert "\n" not in str(caught.value) and "top secret" not in str(caught.value)
    assert _tree(world["tmp"]) == before


@pytest.mark.parametrize("sql, expected", [
    ("COPY (SELECT 1 AS episode_id) TO 'steps.parquet'", "refused a statement of type COPY"),
    ("ATTACH 'x.db'", "refused a statement of type ATTACH"),
    ("select episode_id from rewards; select 1", "expected one SQL statement, got 2"),
    ("select content as episode_id from read_text('/etc/hostname')", "Permission Error"),
    ("select step_idx from steps", "must return a column named episode_id"),
])
def test_a_hostile_select_sql_is_refused_at_config_check(sql, expected):
    with pytest.raises(ConfigError) as caught:
        build_config({"warm_start": {"select_sql": sql}})
    message = str(caught.value)
    assert "warm_start.select_sql" in message and expected in message and "\n" not in message


def test_a_hostile_select_sql_stops_train_before_anything_starts(tmp_path, capsys):
    data_root = tmp_path / "data"
    code = cli_main(["train", "--config", "tiny", "--data-root", str(data_root), "--dry-run",
                     "--set", f"warm_start.select_sql=COPY (SELECT 1 AS episode_id) TO '{tmp_path / 'x.csv'}'"])
    assert code == 2
    err = capsys.readouterr().err
    assert "warm_start.select_sql" in err and "refused a statement of type COPY" in err and err.count("\n") == 1
    assert not data_root.exists() and not (tmp_path / "x.csv").exists()


def test_a_plain_select_sql_passes_the_config_check():
    sql = "select distinct r.episode_id from rewards r join steps s using (episode_id) where r.em = 1"
    assert build_config({"warm_start": {"select_sql": sql, "lazy_fraction": 0}}).warm_start.select_sql == sql
