"""The iteration page's episode filter: a user's `where` clause over the rows the page shows, and
nothing else (issue 55: a filter with a subquery into `prompts` read the gold answers through an
error page, and one over `range(...)` kept a core busy minutes after its client left).

Three locks, each enough for the reads: (1) before anything runs, DuckDB's own parse tree
(`json_serialize_sql`) must be `SELECT * FROM episodes WHERE <expression> <our ORDER BY/LIMIT>`
with no subquery in the expression; (2) it runs on a read-only catalog holding only the iteration's
episode rows (no table file, no other table); (3) a message that could quote data (any error
raised while running: `error(...)`, a failed cast) is not shown, only its kind. It runs in a child
process killed at the time limit: DuckDB's interrupt is not enough (`list_sum(range(10^8))` is
folded by the optimizer and ignored it for minutes). The child imports this module only: keep its
imports light (it starts in about a second).
"""

from __future__ import annotations

import json
import multiprocessing
from multiprocessing.connection import Connection

import duckdb
import pyarrow as pa

from agent_core.io.readonly_sql import QueryError, ReadOnlyCatalog

FILTER_TIMEOUT_S = 10.0  # a filter over one iteration's episodes (hundreds to thousands of rows) takes well under 1 s
STARTUP_S = 60.0  # the child's own start (imports), not counted in the filter's time limit
VIEW = "episodes"  # the only table the filter's catalog holds
_NESTED = ("subquery", "node", "from_table", "cte_map")  # keys that only a query (not an expression) has


class FilterError(ValueError):
    """A filter refused or failed; the message quotes nothing but the filter's own text."""


def filter_rows(rows: pa.Table, where: str, order: str, timeout: float = FILTER_TIMEOUT_S) -> pa.Table:
    """`rows` (the view `episodes`) filtered by a user's `where`, then `order` (our ORDER BY ... LIMIT);
    FilterError saying why not, quoting no data."""
    sql = f"SELECT * FROM {VIEW} WHERE ({where}\n) {order}"  # the newline ends a trailing -- comment
    check_filter(sql, f"SELECT * FROM {VIEW} WHERE (TRUE\n) {order}")
    return _in_child(rows, sql, timeout)


def check_filter(sql: str, reference: str) -> None:
    """FilterError unless `sql` parses as `reference` with only the WHERE expression differing, and
    that expression holds no subquery (so no other table, table function or CTE)."""
    tree, expected = _parse(sql), _parse(reference)
    if tree.get("error"):
        raise FilterError(f"the filter does not parse: {tree.get('error_message', '')}")
    where = tree["statements"][0]["node"].pop("where_clause", None) if len(tree["statements"]) == 1 else None
    expected["statements"][0]["node"].pop("where_clause")
    if where is None or tree != expected or _has_query(where):
        raise FilterError("the filter must be one expression over the episode columns, e.g. `reward > 0 AND "
                          "steps >= 2`: no subquery, table, table function or second clause")


def _parse(sql: str) -> dict:
    """DuckDB's parse tree of `sql` (parsed, never run), without positions in the text."""
    with duckdb.connect() as con:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
    return _without_locations(tree)


def _without_locations(value):
    if isinstance(value, dict):
        return {k: _without_locations(v) for k, v in value.items() if not k.startswith("query_location")}
    if isinstance(value, list):
        return [_without_locations(v) for v in value]
    return value


def _has_query(value) -> bool:
    if isinstance(value, dict):
        return value.get("class") == "SUBQUERY" or any(k in _NESTED for k in value) or any(
            _has_query(v) for v in value.values())
    return isinstance(value, list) and any(_has_query(v) for v in value)


def _in_child(rows: pa.Table, sql: str, timeout: float) -> pa.Table:
    """Run `sql` over `rows` in a child process, killed once `timeout` seconds of running pass."""
    context = multiprocessing.get_context("spawn")  # no fork of a threaded server holding DuckDB connections
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_evaluate, args=(rows, sql, send), name="agentr1-filter", daemon=True)
    child.start()
    send.close()
    try:
        if not (receive.poll(STARTUP_S) and _receive(receive, "did not start")[0] == "ready"):
            raise FilterError(f"the filter's process did not start within {STARTUP_S:g} s")
        if not receive.poll(timeout):
            raise FilterError(f"the filter ran longer than {timeout:g} s and was stopped")
        kind, value = _receive(receive, "ended without an answer (out of memory?)")
        if kind == "rows":
            return value
        raise FilterError(value)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()


def _receive(receive: Connection, died: str) -> tuple[str, object]:
    try:
        return receive.recv()
    except EOFError:  # the child ended first
        raise FilterError(f"the filter's process {died}") from None


def _evaluate(rows: pa.Table, sql: str, send: Connection) -> None:
    """In the child: `sql` over `rows` only, on a read-only catalog (no file readable)."""
    try:
        with ReadOnlyCatalog({}, data={VIEW: rows}) as catalog:
            send.send(("ready", None))
            try:
                relation = catalog.relation(sql)  # bound, not run: a Binder error names only the filter's text
            except QueryError as error:
                send.send(("refused", f"the filter cannot run: {error}"))
                return
            try:
                send.send(("rows", relation.to_arrow_table()))
            except duckdb.Error as error:  # its message can quote the data (error(...), a failed cast): not shown
                send.send(("failed", f"the filter failed while running ({type(error).__name__}; DuckDB's message "
                                     "is not shown, since it can quote the tables)"))
    finally:
        send.close()
