"""Read-only SQL: the one way SQL written by a user reaches DuckDB (`agentr1 query`, `warm_start.select_sql`,
and any later user-written check).

Two locks: `check_select` refuses, unrun, all but exactly one SELECT; the connection (`ReadOnlyCatalog`) reads
only the view files in `allowed_paths`, with external access, extensions, replacement scans and config changes
off. User SQL goes through `ReadOnlyCatalog.select`/`relation` only: the statement check is what stops writes.
Design notes: docs/architecture.md §11 (agent_core/io/readonly_sql.py).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

_LINE_MARK = re.compile(r"\n\s*LINE \d+:.*", re.DOTALL)  # DuckDB's caret under the query: noise on one line


_ONLY_SELECT = ("only a single SELECT (or WITH ... SELECT) runs here, and it only reads the tables "
                "(`agentr1 query --output FILE` writes a result)")
_READS_ONLY_VIEWS = "a query reads only the data root's tables, through the views"


class QueryError(ValueError):
    """SQL that was refused or failed; one line: what, where, and the views a query can read."""

    def __init__(self, message: str, views: Sequence[str] | None = None):
        self.views = list(views or [])
        told = "" if views is None else f"; available views: {', '.join(self.views) or '(none)'}"
        super().__init__(f"{one_line(message)}{told}")


class QueryInterrupted(QueryError):
    """A query stopped by its timeout (`select(timeout=...)`)."""


_MEMORY = re.compile(r"^\s*\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)


def check_memory_limit(text: str) -> str:
    """`text` if it is a memory size DuckDB takes (e.g. "4GB", "512 MiB"); else ValueError."""
    if not _MEMORY.match(str(text)):
        raise ValueError(f"not a memory size: {text!r} (e.g. 4GB, 512MiB; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return str(text).strip()


def default_memory_limit() -> str:
    """A quarter of the memory this process may use: the machine's, or its cgroup's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        cgroup = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(cgroup)) if cgroup.isdigit() else total
    except OSError:
        pass
    return f"{max(total // 4 // 2**20, 64)}MiB"


def one_line(text: object) -> str:
    """DuckDB's message on one line: the `LINE 1: ... ^` pointer dropped, whitespace runs collapsed."""
    return " ".join(_LINE_MARK.sub("", str(text)).split())


def check_select(sql: str) -> duckdb.Statement:
    """The one statement of `sql` if it is a SELECT; else QueryError (nothing has run)."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as error:
        raise QueryError(f"cannot parse the SQL: {error}") from None
    if len(statements) != 1:
        raise QueryError(f"expected one SQL statement, got {len(statements)}: {_ONLY_SELECT}")
    statement = statements[0]
    if statement.type != duckdb.StatementType.SELECT:
        raise QueryError(f"refused a statement of type {statement.type.name}: {_ONLY_SELECT}")
    return statement


@dataclass(frozen=True)
class TableFile:
    """A Parquet file a view reads: `read` is the path DuckDB opens (a snapshot hard link, or the
    file itself), `real` the table file it stands for, the one an error names."""

    read: Path
    real: Path


def sql_string(text: str) -> str:
    """`text` as a SQL string literal (quotes doubled)."""
    return "'" + text.replace("'", "''") + "'"


class ReadOnlyCatalog:
    """An in-memory DuckDB connection with one view per table, that can read only those views' files.

    `tables`: view name -> its files; a name with no file is an empty view of `schemas[name]`
    (no view where there is no schema either). `data`: view name -> rows our code computed (the
    viewer's filter sees only these). Use `select` to run a user's SQL.
    """

    def __init__(self, tables: Mapping[str, Sequence[TableFile]], schemas: Mapping[str, pa.Schema] | None = None,
                 memory_limit: str | None = None, data: Mapping[str, pa.Table] | None = None):
        schemas = schemas or {}
        self._files = {str(f.read): (f.real, name) for name, files in tables.items() for f in files}
        self.memory_limit = check_memory_limit(memory_limit) if memory_limit else default_memory_limit()
        self._temp = tempfile.mkdtemp(prefix="agentr1-duckdb-")  # 0700: this user's alone
        self._done = threading.Event()  # set while no query runs in a worker
        self._done.set()
        self._con = duckdb.connect(":memory:")
        try:
            con = self._con
            con.execute(f"SET temp_directory = {sql_string(self._temp)}")
            con.execute(f"SET memory_limit = {sql_string(self.memory_limit)}")
            con.execute(f"SET allowed_paths = [{', '.join(sql_string(path) for path in self._files)}]")
            for setting in ("enable_external_access", "autoinstall_known_extensions", "autoload_known_extensions",
                            "python_enable_replacements"):
                con.execute(f"SET {setting} = false")
            for name, files in tables.items():
                _create_view(con, name, [str(f.read) for f in files], schemas.get(name))
            for name, table in (data or {}).items():
                con.register(name, table)
            con.execute("SET lock_configuration = true")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "ReadOnlyCatalog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and remove the temporary folder; a query still running in its worker
        (interrupted, not yet returned) keeps the connection: the process is ending anyway."""
        if self._done.is_set():
            self._con.close()
        shutil.rmtree(self._temp, ignore_errors=True)

    def views(self) -> list[str]:
        """Names of the views a query can read (registered empty tables included), sorted."""
        rows = self._con.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY view_name").fetchall()
        return [name for (name,) in rows]

    def add_view(self, name: str, select: str) -> None:
        """A view the project defines over the table views (e.g. agent_core/io/ledger.py's `costs`); never
        a user's SQL, which goes through `select` only. Reads nothing beyond the views it names."""
        check_select(select)
        try:
            self._con.execute(f'CREATE VIEW "{name}" AS {select}')
        except duckdb.Error:  # over a damaged table: only the queries that touch it fail
            _create_deferred_view(self._con, name, select)

    def relation(self, sql: str, columns: Sequence[str] = ()) -> duckdb.DuckDBPyRelation:
        """`sql` checked (`check_select`) and bound, not run: QueryError unless it returns `columns`."""
        statement = check_select(sql)
        try:
            relation = self._con.sql(statement)
        except duckdb.Error as error:
            raise self.error(error) from None
        missing = [name for name in columns if name not in relation.columns]
        if missing:
            raise QueryError(f"the query must return a column named {', '.join(missing)}: {sql}", self.views())
        return relation

    def select(self, sql: str, columns: Sequence[str] = (), timeout: float | None = None) -> pa.Table:
        """Run a user's `sql` (one SELECT, returning `columns`); its result, or QueryError in one line.

        It runs in a worker thread: Ctrl-C in the main thread interrupts it (KeyboardInterrupt is
        raised again once DuckDB stopped), and so does `timeout` seconds passing (QueryInterrupted)."""
        relation = self.relation(sql, columns)
        outcome: dict[str, object] = {}
        self._done = done = threading.Event()  # not Thread.join: a join cut by Ctrl-C can leave is_alive() wrong

        def run() -> None:
            try:
                outcome["table"] = relation.to_arrow_table()
            except BaseException as error:  # handed to the main thread
                outcome["error"] = error
            finally:
                done.set()

        threading.Thread(target=run, name="agentr1-query", daemon=True).start()
        try:
            finished = done.wait(timeout)
        except KeyboardInterrupt:
            self._stop()
            raise
        if not finished:
            self._stop()
            raise QueryInterrupted(f"the query timed out after {timeout:g} s and was interrupted")
        error = outcome.get("error")
        if isinstance(error, duckdb.Error):
            raise self.error(error) from None
        if error is not None:
            raise error
        return outcome["table"]

    def _stop(self) -> None:
        """Interrupt the running query and give DuckDB a few seconds to return."""
        self._con.interrupt()
        self._done.wait(10)

    def _damaged_files(self) -> list[tuple[Path, str]]:
        """(file, view) of each view's file whose Parquet footer does not decode."""
        return [(Path(real), view) for read, (real, view) in self._files.items() if _is_damaged(read)]

    def error(self, error: Exception) -> QueryError:
        """`error` as a QueryError: snapshot link paths replaced by the table files they stand for,
        and the views of the files it names, so a damaged file is named where it really is."""
        message, views = str(error), []
        for read, (real, view) in self._files.items():
            if read in message:
                message = message.replace(read, str(real))
                views.append(view)
            elif str(real) in message:
                views.append(view)
        if views and "Permission denied" in message:  # EACCES: the file may be whole, this user may not read it
            names = ", ".join(dict.fromkeys(views))
            message = (f"view {names}: {one_line(message)} (permission denied: this user may not read that table "
                       "file; fix its permissions or owner, or run as a user who may; queries over other views "
                       "still answer)")
        elif views:
            names = ", ".join(dict.fromkeys(views))
            message = (f"view {names}: {one_line(message)} (a damaged or unreadable table file; "
                       "queries over other views still answer)")
        elif _READING_FILES.search(message) and (damaged := self._damaged_files()):
            # DuckDB names no file for a damaged footer (TProtocolException: Invalid data): find it
            names = ", ".join(dict.fromkeys(view for _, view in damaged))
            message = (f"view {names}: {one_line(message)} in {', '.join(str(real) for real, _ in damaged)} (a damaged "
                       "table file; queries over other views still answer)")
        elif isinstance(error, duckdb.PermissionException):
            message = f"{one_line(message)} ({_READS_ONLY_VIEWS})"
        elif isinstance(error, duckdb.OutOfMemoryException):
            message = (f"{one_line(message.split('Possible solutions')[0])} (the query's memory limit is "
                       f"{self.memory_limit}; `agentr1 query --memory-limit` sets it)")
        return QueryError(message, self.views())


# DuckDB's words for a file it could not decode (and may not name)
_READING_FILES = re.compile(r"TProtocol|[Tt]hrift|[Pp]arquet|footer|magic bytes|IO Error|Invalid Input Error")


def _is_damaged(path: str) -> bool:
    """Whether the Parquet file at `path` has an unreadable footer (what DuckDB reads first)."""
    try:
        pq.read_metadata(path)
    except (pa.ArrowException, OSError, UnicodeDecodeError):
        return True
    return False


def _create_view(con: duckdb.DuckDBPyConnection, name: str, files: list[str], schema: pa.Schema | None) -> None:
    """Create view `name` over `files`, or an empty one from `schema`; none if neither exists."""
    if not files:
        if schema is not None:
            # A registered Arrow table acts as a view; the connection keeps the (empty) table alive.
            con.register(name, schema.empty_table())
        return
    paths = ", ".join(sql_string(path) for path in files)
    source = f"SELECT * FROM read_parquet([{paths}], hive_partitioning = false, union_by_name = true)"
    try:
        con.execute(f'CREATE VIEW "{name}" AS {source}')
    except duckdb.Error:
        _create_deferred_view(con, name, source)


def _create_deferred_view(con: duckdb.DuckDBPyConnection, name: str, source: str) -> None:
    """View `name` over `source` that DuckDB could not read now (a damaged file): CREATE VIEW reads
    every file's footer and would fail, taking every later view and query with it. `query()` binds
    its SQL text at each use and the text sits in a variable, so the view is created over a
    placeholder and then pointed at `source`: each query that touches it fails with DuckDB's own
    message naming the file; the other views answer. (A user's SQL cannot SET VARIABLE: it is not
    a SELECT.)"""
    variable = f"agentr1_view_{name}"
    con.execute(f"SET VARIABLE {variable} = 'SELECT NULL AS unreadable'")
    con.execute(f'CREATE VIEW "{name}" AS FROM query(getvariable({sql_string(variable)}))')
    con.execute(f"SET VARIABLE {variable} = {sql_string(source)}")
