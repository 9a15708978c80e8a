"""Building blocks of the table schemas: Arrow types, row checks, JSON-shape checks, row ids.

Every table is a `pandera.pyarrow.DataFrameModel` that validates a `pyarrow.Table` natively
(pandera 0.35 runs it through narwhals on Arrow memory). Every data check is a *row check*: a
function `pa.Table -> boolean array` (True = row is fine, null = not judged because the value is
null, which the column's own nullability rule handles) built from `pyarrow.compute` kernels, so
100k rows of nested lists validate without a Python loop over rows. The same function that
pandera runs is run again only when it failed, to name the offending rows (pandera's own failure
indices are not reliable for the pyarrow backend: for null checks they point at wrong rows).

JSON text columns are checked with Arrow's C++ JSON reader (one parse per column, not one
`json.loads` per cell, which costs ~6 us a cell on this machine), see `json_check`.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandera.pyarrow as pap
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

# Column types, named so a model reads like the table contract.
STRING = pa.string()
INT32 = pa.int32()
INT64 = pa.int64()
FLOAT64 = pa.float64()
BOOL = pa.bool_()
LIST_INT32 = pa.list_(pa.int32())
LIST_FLOAT32 = pa.list_(pa.float32())

RowsOk = Callable[[pa.Table], pa.Array | pa.ChunkedArray]


class ArrowModel(pap.DataFrameModel):
    """Base of every table model. Subclasses must not use `from __future__ import annotations`:
    the column annotations are Arrow type objects, read as they are."""

    class Config:
        strict = True
        ordered = True


@dataclass(frozen=True)
class RowCheck:
    """A named check of one column (or of the table when column is None)."""

    column: str | None
    name: str
    rows_ok: RowsOk


def row_check(column: str | None, name: str, rows_ok: RowsOk) -> classmethod:
    """Declare a row check inside a model class body (`_name = row_check(...)`).

    The returned classmethod is a pandera native check (it receives the whole Arrow table) and
    carries the RowCheck, so a failure can be traced back to its rows (`declared_row_checks`).
    """

    def run(cls, data):
        return rows_ok(data.table)

    run.__doc__ = name
    decorate = pap.check(column, name=name) if column else pap.dataframe_check(name=name)
    method = decorate(run)
    method.row_check = RowCheck(column, name, rows_ok)
    return method


def declared_row_checks(model: type) -> dict[tuple[str | None, str], RowCheck]:
    found = {}
    for klass in reversed(model.__mro__):
        for attribute in vars(klass).values():
            check = getattr(attribute, "row_check", None)
            if isinstance(check, RowCheck):
                found[(check.column, check.name)] = check
    return found


def arrow_schema_of(model: type[ArrowModel]) -> pa.Schema:
    """The model's columns as an Arrow schema, in declaration order, with their nullability."""
    columns = model.to_schema().columns
    return pa.schema(
        [pa.field(name, dtype, nullable=bool(columns[name].nullable)) for name, dtype in model.__annotations__.items()]
    )


def column_array(table: pa.Table, column: str) -> pa.Array:
    """One contiguous array (list offsets and parent indices are per chunk otherwise)."""
    chunked = table[column]
    return chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()


# ---- row checks of one value ------------------------------------------------------------------


def at_least(column: str, bound: float) -> RowsOk:
    return lambda t: pc.greater_equal(t[column], bound)


def finite(column: str) -> RowsOk:
    return lambda t: pc.is_finite(t[column])


def in_unit_interval(column: str) -> RowsOk:
    return lambda t: pc.and_(pc.greater_equal(t[column], 0.0), pc.less_equal(t[column], 1.0))


def one_of(column: str, choices: tuple[str, ...]) -> RowsOk:
    # is_in says False for null; a null is judged by the nullability rule, so keep it null.
    value_set = pa.array(choices, pa.string())
    return lambda t: null_where_null(t[column], pc.is_in(t[column], value_set=value_set))


def set_iff(column: str, flag: str) -> RowsOk:
    """`column` holds a value exactly on the rows where `flag` is True."""
    return lambda t: pc.equal(pc.is_valid(t[column]), t[flag])


def null_where_null(values, ok):
    """Leave rows whose value is null unjudged: the column's nullability rule speaks for them."""
    return pc.if_else(pc.is_null(values), pa.scalar(None, pa.bool_()), ok)


def finite_unless(column: str, flag: str) -> RowsOk:
    return lambda t: pc.or_kleene(t[flag], pc.is_finite(t[column]))


# ---- row checks of list values ----------------------------------------------------------------


def non_empty_list(column: str) -> RowsOk:
    return lambda t: pc.greater(pc.list_value_length(t[column]), 0)


def same_list_length(column: str, other: str) -> RowsOk:
    return lambda t: pc.equal(pc.list_value_length(t[column]), pc.list_value_length(t[other]))


def all_items(lists: pa.Array, item_ok: Callable[[pa.Array], pa.Array]) -> pa.Array:
    """Per list: True when every item passes `item_ok` (a null item fails); null for a null list.

    Counts failing items with one cumulative sum over the flat values and reads each list's count
    off its offsets, so no per-row loop is needed.
    """
    bad_items = pc.invert(pc.fill_null(item_ok(lists.values), False)).cast(pa.int64())
    bad_so_far = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(bad_items)])
    offsets = lists.offsets
    starts = pc.take(bad_so_far, offsets.slice(0, len(lists)))
    ends = pc.take(bad_so_far, offsets.slice(1, len(lists)))
    return null_where_null(lists, pc.equal(pc.subtract(ends, starts), 0))


def list_items_at_least(column: str, bound: float) -> RowsOk:
    return lambda t: all_items(column_array(t, column), lambda items: pc.greater_equal(items, bound))


def list_items_finite(column: str, at_most: float | None = None) -> RowsOk:
    def item_ok(items):
        ok = pc.is_finite(items)
        return ok if at_most is None else pc.and_(ok, pc.less_equal(items, at_most))

    return lambda t: all_items(column_array(t, column), item_ok)


# ---- row checks across rows -------------------------------------------------------------------


def unique_key(columns: tuple[str, ...]) -> RowsOk:
    """False on every row whose key already appeared on an earlier row (the first stays True)."""

    def rows_ok(t: pa.Table) -> pa.Array:
        if t.num_rows < 2:
            return pa.array([True] * t.num_rows, pa.bool_())
        keys = [(c, "ascending") for c in columns]
        order = pc.sort_indices(t.select(list(columns)), sort_keys=keys).cast(pa.int64())
        repeated = None
        for column in columns:
            ordered = pc.take(column_array(t, column), order)
            same = pc.fill_null(pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1)), False)
            repeated = same if repeated is None else pc.and_(repeated, same)
        repeated_in_order = pa.concat_arrays([pa.array([False]), repeated])
        return pc.invert(pc.take(repeated_in_order, pc.inverse_permutation(order)))

    return rows_ok


def per_group(table: pa.Table, key: str, aggregates: list[tuple[str, str]]) -> tuple[pa.Table, pa.Array]:
    """Group-level aggregates and, for each row, the index of its group in them."""
    groups = table.group_by(key, use_threads=False).aggregate(aggregates)
    return groups, pc.index_in(table[key], value_set=groups[key])


# ---- JSON text columns ------------------------------------------------------------------------

_STRING_LITERAL = r'"(?:[^"\\]|\\.)*"'
_INNERMOST_CONTAINER = r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}"
_MAX_JSON_DEPTH = 32
_WS = r"[ \t\n\r]*"
_JSON_STRING = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_JSON_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_PAIR = _JSON_STRING + _WS + ":" + _WS + _JSON_NUMBER + _WS
_FLAT_NUMBER_OBJECT = rf"^{_WS}\{{{_WS}(?:{_PAIR}(?:,{_WS}{_PAIR})*)?\}}{_WS}$"


@dataclass(frozen=True)
class JsonShape:
    """What a JSON text column must hold.

    kind: "object" or "list", the outermost value. accepts: the plain definition, a predicate on
    the `json.loads` value. value_type / values_ok: the same rule for the vectorised path: what
    Arrow's reader parses the value into (for an object, a struct of the fields to read, others
    ignored, an empty struct being any object; for a list, a list type; None reads nothing) and
    the checks on the parsed values.
    """

    description: str
    kind: str
    accepts: Callable[[Any], bool]
    value_type: pa.DataType | None = None
    values_ok: Callable[[pa.Array], pa.Array] | None = None


def json_check(column: str, shape: JsonShape) -> RowsOk:
    """Each cell parses as JSON of `shape`.

    Fast path: the whole column goes through Arrow's JSON reader in one call. It is trusted only
    when the call succeeds (a type the reader cannot fit makes it fail); otherwise every cell is
    judged by `json.loads` + `shape.accepts` (~7 us a cell), which is the definition.
    """

    def rows_ok(t: pa.Table) -> pa.Array:
        text = column_array(t, column)
        ok = _json_check_vectorised(text, shape)
        if ok is None:
            ok = pa.array([_accepts(value, shape.accepts) for value in text.to_pylist()], pa.bool_())
        return null_where_null(text, ok)

    return rows_ok


def _accepts(text: str | None, accepts: Callable[[Any], bool]) -> bool:
    if text is None:
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return bool(accepts(value))


def _json_check_vectorised(text: pa.Array, shape: JsonShape) -> pa.Array | None:
    """The reader wants one object per line. Raw line breaks become tabs (both are whitespace
    between tokens and invalid inside strings, so validity is unchanged). An object cell is its
    own line (a cell holding two values shows up as two rows); a list cell is wrapped as
    `{"v": <cell>}`, which a cell like `[], "k": 1` could escape, so it must also be one value."""
    opener, placeholder = ("[", "[]") if shape.kind == "list" else ("{", "{}")
    lines = _one_line_each(pc.fill_null(text, placeholder))
    kind_ok = pc.match_substring_regex(lines, rf"^[ \t]*\{opener}")
    # Only lines that start like an object reach the reader: a bare `null` line crashed it.
    lines = pc.if_else(kind_ok, lines, placeholder)
    if shape.kind == "list":
        schema = pa.schema([] if shape.value_type is None else [("v", shape.value_type)])
        parsed = _read_json_lines(pc.binary_join_element_wise('{"v":', lines, "}", ""), schema)
        ok = kind_ok if parsed is None else pc.and_(kind_ok, _single_list_value(lines))
        values = None if parsed is None or shape.value_type is None else parsed["v"].combine_chunks()
    else:
        schema = pa.schema([] if shape.value_type is None else list(shape.value_type))
        parsed = _read_json_lines(lines, schema)
        ok = kind_ok
        values = None if parsed is None or shape.value_type is None else parsed.to_struct_array().combine_chunks()
    if parsed is None:
        return None
    if shape.values_ok is not None:
        ok = pc.and_(ok, pc.fill_null(shape.values_ok(values), False))
    return ok


def _one_line_each(text: pa.Array) -> pa.Array:
    if pc.any(pc.match_substring(text, "\n")).as_py() or pc.any(pc.match_substring(text, "\r")).as_py():
        return pc.replace_substring_regex(text, r"[\r\n]", "\t")
    return text


def _read_json_lines(lines: pa.Array, schema: pa.Schema) -> pa.Table | None:
    if len(lines) == 0:
        return schema.empty_table()
    joined = pc.binary_join(pa.ListArray.from_arrays(pa.array([0, len(lines)], pa.int32()), lines), "\n")[0]
    block_size = max(1 << 20, pc.max(pc.binary_length(lines)).as_py() + 2)
    try:
        table = pa_json.read_json(
            pa.BufferReader(joined.as_buffer()),
            read_options=pa_json.ReadOptions(block_size=block_size, use_threads=False),
            parse_options=pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    # A line holding two values parses as two rows (and a blank line as none).
    return table if table.num_rows == len(lines) else None


def _single_list_value(lines: pa.Array) -> pa.Array:
    """Escaping the wrapper needs the list to close and a `,` to follow: only cells with `]`
    then `,` somewhere get the full (regex-heavy) test."""
    suspect = pc.match_substring_regex(lines, r"\][ \t]*,")
    ok = pc.fill_null(pa.nulls(len(lines), pa.bool_()), True)
    if not pc.any(suspect).as_py():
        return ok
    return pc.replace_with_mask(ok, suspect, single_json_value(pc.filter(lines, suspect)))


def single_json_value(text: pa.Array) -> pa.Array:
    """True where `text` (known to parse inside a wrapper) is one JSON value, not `a, "k": b`.

    Strings are blanked (they may hold brackets), then innermost containers are folded to `0`
    until none is left; what remains must hold no separator. Deeper nesting than _MAX_JSON_DEPTH
    counts as not a single value.
    """
    folded = pc.replace_substring_regex(text, _STRING_LITERAL, '""')
    for _ in range(_MAX_JSON_DEPTH):
        if not pc.any(pc.match_substring_regex(folded, r"[\[{]")).as_py():
            break
        folded = pc.replace_substring_regex(folded, _INNERMOST_CONTAINER, "0")
    return pc.invert(pc.match_substring_regex(folded, r"[\[\]{},:]"))


def json_number_map(column: str) -> RowsOk:
    """Each cell is a flat JSON object of name -> number (checked exactly by one regex)."""
    return lambda t: pc.match_substring_regex(t[column], _FLAT_NUMBER_OBJECT)


# ---- row ids in error messages ----------------------------------------------------------------


def row_ids(table: pa.Table, rows: pa.Array, id_columns: tuple[str, ...]) -> list[str]:
    """`<id>/<id>` strings for the given row indices ("<null>" for a missing id value)."""
    parts = [pc.fill_null(pc.take(table[c], rows).cast(pa.string()), "<null>") for c in id_columns]
    return pc.binary_join_element_wise(*parts, "/").to_pylist()


def describe_rows(ids: list[str], count: int, shown: int = 10) -> str:
    listed = ", ".join(ids[:shown]) + (", ..." if count > shown else "")
    return f"[{listed}] ({count} row{'s' if count != 1 else ''})"

