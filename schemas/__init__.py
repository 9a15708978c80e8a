"""The tables every stage writes and reads (docs/architecture.md §5), and their validation.

`TABLES[name]` gives each table's exact Arrow schema, its pandera model (`pandera.pyarrow`,
validating the Arrow table natively: no pandas conversion, no per-row Python except where a
check fails) and the columns that name a row in error messages. `validate(name, table)` is the
one entry point: it conforms the table to the schema (column order, safe casts), runs the model
and raises `TableValidationError` naming the table, the column, the check and the offending rows.

This package imports nothing from the project; `agent_core.io.tables` does the disk side.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandera.errors as pandera_errors
import pandera.pyarrow as pandera_pyarrow
import pyarrow as pa
import pyarrow.compute as pc

from schemas import advantages, dataset, health, prompts, rewards, steps, train_metrics
from schemas import ledger
from schemas import eval as eval_schema  # plain `eval` would shadow the builtin here
from schemas._base import ArrowModel, declared_row_checks, describe_rows, row_ids

__all__ = [
    "TABLES",
    "CheckFailure",
    "TableSpec",
    "TableValidationError",
    "UnknownTableError",
    "table_from_rows",
    "table_spec",
    "validate",
]


@dataclass(frozen=True)
class TableSpec:
    """defaults: columns added after tables were written, with the value an older table (or rows
    without the column) gets in every row, so old runs still read."""

    name: str
    arrow_schema: pa.Schema
    model: type[ArrowModel]
    row_id_columns: tuple[str, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)


TABLES: dict[str, TableSpec] = {
    spec.name: spec
    for spec in (
        TableSpec("dataset_prompts", dataset.DATASET_PROMPTS_ARROW_SCHEMA, dataset.DatasetPromptsModel,
                  dataset.DATASET_PROMPTS_ROW_ID_COLUMNS),
        TableSpec("corpus", dataset.CORPUS_ARROW_SCHEMA, dataset.CorpusModel, dataset.CORPUS_ROW_ID_COLUMNS),
        TableSpec("prompts", prompts.ARROW_SCHEMA, prompts.PromptsModel, prompts.ROW_ID_COLUMNS),
        TableSpec("steps", steps.ARROW_SCHEMA, steps.StepsModel, steps.ROW_ID_COLUMNS, steps.COLUMN_DEFAULTS),
        TableSpec("rewards", rewards.ARROW_SCHEMA, rewards.RewardsModel, rewards.ROW_ID_COLUMNS),
        TableSpec("advantages", advantages.ARROW_SCHEMA, advantages.AdvantagesModel, advantages.ROW_ID_COLUMNS),
        TableSpec("train_metrics", train_metrics.ARROW_SCHEMA, train_metrics.TrainMetricsModel,
                  train_metrics.ROW_ID_COLUMNS, train_metrics.COLUMN_DEFAULTS),
        TableSpec("eval", eval_schema.ARROW_SCHEMA, eval_schema.EvalModel, eval_schema.ROW_ID_COLUMNS),
        TableSpec("health", health.ARROW_SCHEMA, health.HealthModel, health.ROW_ID_COLUMNS),
        TableSpec("ledger", ledger.ARROW_SCHEMA, ledger.LedgerModel, ledger.ROW_ID_COLUMNS),
    )
}


class UnknownTableError(ValueError):
    def __init__(self, name: str):
        self.name = name
        super().__init__(f"unknown table {name!r}; valid tables: {', '.join(TABLES)}")


@dataclass(frozen=True)
class CheckFailure:
    """One failed check. row_ids: every offending row (message shows the first 10)."""

    column: str | None
    check: str
    row_ids: tuple[str, ...] = ()
    row_count: int = 0
    detail: str | None = None

    def describe(self) -> str:
        text = f"column '{self.column}' failed" if self.column else "failed"
        text += f" check '{self.check}'"
        if self.row_count:
            text += f" at rows {describe_rows(list(self.row_ids), self.row_count)}"
        return text + (f": {self.detail}" if self.detail else "")


class TableValidationError(ValueError):
    """A table broke its schema. `column`, `check`, `row_ids` and `row_count` describe the first
    failure; `failures` holds all of them; `source` is the file, when the table came from one."""

    def __init__(self, table: str, failures: Iterable[CheckFailure], source: str | None = None):
        self.table = table
        self.failures = tuple(failures)
        self.source = source
        first = self.failures[0]
        self.column, self.check, self.row_ids, self.row_count = first.column, first.check, list(first.row_ids), first.row_count
        where = f"{table} ({source})" if source else table
        message = f"{where}: {first.describe()}"
        others = self.failures[1:]
        if others:
            message += "; also " + "; ".join(f.describe() for f in others[:5])
            message += f"; and {len(others) - 5} more" if len(others) > 5 else ""
        super().__init__(message)

    def with_source(self, source: str) -> "TableValidationError":
        return TableValidationError(self.table, self.failures, source)


def table_spec(name: str) -> TableSpec:
    try:
        return TABLES[name]
    except KeyError:
        raise UnknownTableError(name) from None


def validate(table_name: str, data: pa.Table) -> pa.Table:
    """Conform `data` to the table's Arrow schema and check it; return the conformed table.

    Columns are put in schema order and safely cast (int64 -> int32, list<double> ->
    list<float>, ...); a missing, unexpected or uncastable column is an error naming it.
    """
    spec = table_spec(table_name)
    if not isinstance(data, pa.Table):
        raise TypeError(f"{table_name}: expected a pyarrow.Table, got {type(data).__name__}")
    conformed = _conform(spec, data).combine_chunks()
    try:
        spec.model.validate(conformed, lazy=True)
    except pandera_errors.SchemaErrors as errors:
        failures = _failures(spec, conformed, errors.schema_errors)
        if failures:
            raise TableValidationError(spec.name, failures) from None
    return pa.Table.from_arrays(conformed.columns, schema=spec.arrow_schema)


def table_from_rows(table_name: str, rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Rows (dicts keyed by column name) as an Arrow table of the table's schema, not yet checked.

    A key no row has, or a key the schema lacks, is an error; a key some rows lack is null there.
    """
    spec = table_spec(table_name)
    rows = list(rows)
    not_mappings = [type(row).__name__ for row in rows if not isinstance(row, Mapping)]
    if not_mappings:
        raise TypeError(f"{table_name}: rows must be dicts of column -> value, got {not_mappings[0]}")
    keys = set().union(*(row.keys() for row in rows)) if rows else set(spec.arrow_schema.names)
    rows = [{**{k: v for k, v in spec.defaults.items() if k not in keys}, **row} for row in rows]
    _check_column_names(spec, keys | set(spec.defaults))
    schema = _nullable(spec.arrow_schema)
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        pass  # convert column by column, to name the column that does not fit
    arrays = []
    for field in spec.arrow_schema:
        try:
            arrays.append(pa.array([row.get(field.name) for row in rows], type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as error:
            failure = CheckFailure(field.name, f"type {field.type}", detail=str(error))
            raise TableValidationError(spec.name, [failure]) from None
    return pa.Table.from_arrays(arrays, schema=schema)


def _nullable(schema: pa.Schema) -> pa.Schema:
    # Nulls in required columns must reach the model, which names their rows.
    return pa.schema([field.with_nullable(True) for field in schema])


def _check_column_names(spec: TableSpec, names: Iterable[str]) -> None:
    names = set(names)
    expected = spec.arrow_schema.names
    failures = [
        CheckFailure(name, "present", detail=f"expected columns: {', '.join(expected)}")
        for name in expected
        if name not in names
    ]
    failures += [
        CheckFailure(name, "known column", detail=f"valid columns: {', '.join(expected)}")
        for name in sorted(names - set(expected))
    ]
    if failures:
        raise TableValidationError(spec.name, failures)


def _with_defaults(spec: TableSpec, data: pa.Table) -> pa.Table:
    """`data` with each defaulted column it lacks (a table written before the column existed)."""
    for name, value in spec.defaults.items():
        if name not in data.column_names:
            column_type = spec.arrow_schema.field(name).type
            data = data.append_column(name, pa.array([value] * data.num_rows, type=column_type))
    return data


def _conform(spec: TableSpec, data: pa.Table) -> pa.Table:
    data = _with_defaults(spec, data)
    _check_column_names(spec, data.column_names)
    columns = []
    for field in spec.arrow_schema:
        column = data[field.name]
        if column.type != field.type:
            try:
                column = pc.cast(column, field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
                detail = f"cannot cast from {column.type}: {error}"
                raise TableValidationError(spec.name, [CheckFailure(field.name, f"type {field.type}", detail=detail)]) from None
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=_nullable(spec.arrow_schema))


def _failures(spec: TableSpec, table: pa.Table, schema_errors: list) -> list[CheckFailure]:
    """Translate pandera's errors into failures with row ids, by rerunning the failed checks
    (pandera's own failure indices are wrong for null checks on Arrow tables)."""
    row_checks = declared_row_checks(spec.model)
    failures = []
    for error in schema_errors:
        column = error.schema.name if isinstance(error.schema, pandera_pyarrow.Column) else None
        check_name = getattr(error.check, "name", None) or str(error.check)
        reason = getattr(error.reason_code, "name", "")
        if reason == "SERIES_CONTAINS_NULLS":
            # pandera counts NaN as null in float columns; in Arrow NaN is a value, which the
            # column's own checks judge (finite, finite unless skipped, ...).
            if table[column].null_count:
                failures.append(_rows_failure(spec, table, column, "not null", pc.is_valid(table[column])))
        elif reason == "DATAFRAME_CHECK" and (column, check_name) in row_checks:
            rows_ok = row_checks[(column, check_name)].rows_ok(table)
            failures.append(_rows_failure(spec, table, column, check_name, rows_ok))
        else:
            failures.append(CheckFailure(column, check_name, detail=_error_text(error)))
    return failures


def _rows_failure(spec: TableSpec, table: pa.Table, column: str | None, check: str, rows_ok) -> CheckFailure:
    bad_rows = pc.indices_nonzero(pc.invert(pc.fill_null(rows_ok, True)))
    ids = row_ids(table, bad_rows, spec.row_id_columns)
    return CheckFailure(column, check, tuple(ids), len(ids))


def _error_text(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
