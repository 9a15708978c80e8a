"""One run's tables as a read-only SQL catalog: what the behaviour audit (agent_core/audit) queries.

The same `ReadOnlyCatalog` as `agentr1 query` (agent_core/io/readonly_sql.py: one SELECT, on a
connection that can read only the views' files), restricted to one run and to the iterations an
audit judges with: the audited ones and the baseline iterations. Restricted, so a check needs no
`WHERE run_id = ...`; it reads exactly the tables the audit's manifest records as its inputs
(tasks/audit.py), so a redone audit of iteration k sees the same rows after iteration k+1 exists
(with runtime.max_staleness >= 1 the next rollout is written before iteration k is audited); and
an audit's cost does not grow with the run's length.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from contextlib import contextmanager
from typing import Iterator

import pyarrow as pa

from agent_core.io.layout import RunLayout
from agent_core.io.query_files import run_table_files, snapshot, table_schemas, table_views
from agent_core.io.readonly_sql import QueryError, ReadOnlyCatalog

_ITERATION = re.compile(r"^iteration=(\d+)$")
AUDIT_COLUMNS = ("iteration", "value")  # what every check's SELECT returns: one value per iteration


def _run_files(run: RunLayout, iterations: Collection[int] | None) -> dict[str, list]:
    """The run's table files by table name, of `iterations` (all: None)."""
    files: dict[str, list] = {}
    for name, paths in run_table_files(run.data_root, run.run_id).items():
        files[name] = []
        for path in paths:
            match = _ITERATION.match(path.parent.name)
            if match is not None and (iterations is None or int(match.group(1)) in iterations):
                files[name].append(path)
    return files


@contextmanager
def open_run_catalog(run: RunLayout, iterations: Collection[int] | None = None) -> Iterator[ReadOnlyCatalog]:
    """A read-only catalog over `run`'s tables of `iterations` (all: None), reading snapshot hard links
    (a table a live run replaces meanwhile is read whole); a table with no file is an empty view."""
    with snapshot(run.data_root) as snapshot_dir:
        with ReadOnlyCatalog(table_views(_run_files(run, iterations), snapshot_dir), table_schemas()) as catalog:
            yield catalog


def check_run_sql(sql: str, columns: Sequence[str] = AUDIT_COLUMNS) -> None:
    """Refuse, before any run starts, an audit SQL the audit would refuse: not one SELECT, a file or
    column or view that does not exist, without `columns`. Bound (not run) against empty views of the
    run tables' schemas; QueryError in one line (DuckDB's own error)."""
    schemas = table_schemas()
    names = [name for name in schemas if name not in ("dataset_prompts", "corpus", "eval")]
    with ReadOnlyCatalog({name: [] for name in names}, schemas) as catalog:
        catalog.relation(sql, columns=columns)


def select_values(catalog: ReadOnlyCatalog, sql: str, timeout: float | None = None) -> pa.Table:
    """Run one audit SELECT: its (iteration, value) columns; QueryError in one line otherwise
    (QueryInterrupted past `timeout` seconds)."""
    return catalog.select(sql, columns=AUDIT_COLUMNS, timeout=timeout).select(list(AUDIT_COLUMNS))


__all__ = ["AUDIT_COLUMNS", "QueryError", "check_run_sql", "health_uri", "open_run_catalog", "select_values"]


def health_uri(run: RunLayout, iteration: int) -> str:
    """The audit's `health` table of an iteration (not one of RUN_TABLES: no stage reads it back)."""
    return str(run.iteration_dir(iteration) / "health.parquet")
