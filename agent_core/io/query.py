"""SQL over every table of a data root, with DuckDB (docs/architecture.md §1, §5).

`open_catalog` gives a read-only DuckDB catalog (`agent_core.io.readonly_sql`), one view per run, dataset and
eval table. Where it differs from the obvious `read_parquet(..., hive_partitioning=true)`: Hive partitioning
is off (the tables' own columns and types are shown), files are listed in Python (hidden paths skipped), each
query reads a hard-link snapshot, and a table with no file yet is an empty view of its schema.
Design notes: docs/architecture.md §11 (agent_core/io/query.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from agent_core.io.ledger import derived_views
from agent_core.io.query_files import (TABLE_FOLDERS, IgnoredFileWarning, dataset_table_files, eval_table_files,
                                       remove_stale_snapshots, run_table_files, snapshot, table_schemas, table_views)
from agent_core.io.query_output import RESULT_SUFFIXES, check_result_path, write_result
from agent_core.io.readonly_sql import QueryError, QueryInterrupted, ReadOnlyCatalog, TableFile, check_select

__all__ = ["IgnoredFileWarning", "QueryError", "QueryInterrupted", "RESULT_SUFFIXES", "TABLE_FOLDERS",
           "check_episode_selection", "check_result_path", "check_select", "dataset_table_files", "eval_table_files",
           "format_table", "has_tables", "open_catalog", "remove_stale_snapshots", "run_query", "run_table_files",
           "select_episode_ids", "write_result"]


def open_catalog(data_root: Path, snapshot_dir: Path | None = None, memory_limit: str | None = None) -> ReadOnlyCatalog:
    """A read-only catalog (`ReadOnlyCatalog`: DuckDB in memory, one view per table of `data_root`,
    nothing else readable; see module doc).

    The file lists are taken now: open a new catalog to see tables written later. With
    `snapshot_dir` (an empty folder on the data root's filesystem), the views read hard links made
    there now instead of the tables' paths: a writer replacing a table (a resumed or rerun stage)
    renames a new file over the path, which DuckDB, opening a file more than once per query, would
    otherwise mix with the old one ("Invalid data"); a link keeps the old file whole until it goes.
    Errors still name the tables' own paths. Without a snapshot, DuckDB is handed each file's
    resolved path, never a symlink. `memory_limit`: DuckDB's (default: a quarter of the memory).
    """
    tables = {**run_table_files(data_root), **dataset_table_files(data_root), **eval_table_files(data_root)}
    catalog = ReadOnlyCatalog(table_views(tables, snapshot_dir), table_schemas(), memory_limit=memory_limit)
    for name, select in derived_views(set(catalog.views())):  # step_costs, costs (io/ledger.py)
        catalog.add_view(name, select)
    return catalog


def has_tables(data_root: Path) -> bool:
    """Whether `data_root` holds any table a query could read (a run's, a dataset's or an eval's)."""
    return any(files for files in (*run_table_files(data_root).values(), *dataset_table_files(data_root).values(),
                                   *eval_table_files(data_root).values()))


def run_query(data_root: Path, sql: str, timeout: float | None = None, memory_limit: str | None = None) -> pa.Table:
    """Run a user's `sql`, one SELECT, over the catalog of `data_root`; the result as an Arrow table.

    Anything else (COPY, ATTACH, SET, several statements, ...) is refused before it runs, and a
    SELECT can read only the tables' files (`agent_core.io.readonly_sql`): QueryError, one line.
    Ctrl-C interrupts it (KeyboardInterrupt), so does `timeout` seconds (QueryInterrupted); the
    snapshot folders of killed queries are removed first (`remove_stale_snapshots`).
    """
    check_select(sql)  # refused before a snapshot folder is made
    remove_stale_snapshots(Path(data_root))
    with snapshot(data_root) as snapshot_dir, open_catalog(data_root, snapshot_dir, memory_limit) as catalog:
        return catalog.select(sql, timeout=timeout)


SELECTION_VIEWS = ("steps", "rewards")


def select_episode_ids(sql: str, tables: dict[str, str]) -> list[str]:
    """Episode ids chosen by `sql` over views named after `tables` (name -> Parquet file), e.g.
    `select episode_id from rewards where em = 1` over {"steps": ..., "rewards": ...}.

    The query must be one SELECT returning an `episode_id` column (read-only, as `run_query`);
    QueryError otherwise, or on a SQL error.
    """
    views = {name: [TableFile(Path(uri), Path(uri))] for name, uri in tables.items()}
    with ReadOnlyCatalog(views, table_schemas()) as catalog:
        result = catalog.select(sql, columns=["episode_id"])
    return [str(v) for v in dict.fromkeys(result.column("episode_id").to_pylist()) if v is not None]


def check_episode_selection(sql: str) -> None:
    """Refuse, before any run starts, a selection `select_episode_ids` would refuse: not a single
    SELECT, reading a file that is not one of its views (DuckDB refuses at bind), a column or view
    that does not exist, no episode_id column. Bound against empty `steps` and `rewards` views of
    their schemas, so nothing is read; QueryError, one line."""
    views = {name: schema for name, schema in table_schemas().items() if name in SELECTION_VIEWS}
    with ReadOnlyCatalog({name: [] for name in SELECTION_VIEWS}, views) as catalog:
        catalog.relation(sql, columns=["episode_id"])


# ---- presenting results ------------------------------------------------------------------------

_MAX_CELL = 40


# DuckDB's infinite dates and timestamps as stored (date32 days, timestamp ticks), as DuckDB prints them
_INFINITE = {2**31 - 1: "infinity", -(2**31 - 1): "-infinity", 2**63 - 1: "infinity", -(2**63 - 1): "-infinity"}


def _column_cells(column: pa.ChunkedArray) -> list[str]:
    """A column's cells as text. A date or time Python cannot hold (`select 'infinity'::date`, year
    300000) is no traceback: DuckDB's word for it (infinity), or its stored number marked out of range."""
    try:
        return [_cell(v) for v in column.to_pylist()]
    except (OverflowError, ValueError):
        return [_scalar_cell(scalar) for scalar in column]


def _scalar_cell(scalar: pa.Scalar) -> str:
    try:
        return _cell(scalar.as_py())
    except (OverflowError, ValueError):
        raw = getattr(scalar, "value", None)
        if isinstance(raw, int):
            return _INFINITE.get(raw, f"<{scalar.type} out of range: {raw}>")
        return f"<{scalar.type} out of range>"


def _cell(value: object) -> str:
    if value is None:
        text = "NULL"
    elif isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, default=str, ensure_ascii=False)
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 3] + "..."


def _is_numeric(data_type: pa.DataType) -> bool:
    return pa.types.is_integer(data_type) or pa.types.is_floating(data_type) or pa.types.is_decimal(data_type)


def format_table(table: pa.Table, max_rows: int = 50) -> str:
    """An aligned plain-text rendering of the first `max_rows` rows (numbers right-aligned,
    long cells cut at 40 characters), with a row count line at the end."""
    if table.num_columns == 0:
        return f"(no columns, {table.num_rows} rows)"
    shown = table.slice(0, max(max_rows, 0))
    columns = [_column_cells(shown.column(i)) for i in range(table.num_columns)]
    headers = list(table.column_names)
    widths = [max([len(h), *(len(c) for c in col)]) for h, col in zip(headers, columns)]
    right = [_is_numeric(field.type) for field in table.schema]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    lines = [line(headers), "  ".join("-" * w for w in widths)]
    lines += [line([col[row] for col in columns]) for row in range(shown.num_rows)]
    if shown.num_rows < table.num_rows:
        lines.append(f"({shown.num_rows} of {table.num_rows} rows shown)")
    else:
        lines.append(f"({table.num_rows} row{'' if table.num_rows == 1 else 's'})")
    return "\n".join(lines)
