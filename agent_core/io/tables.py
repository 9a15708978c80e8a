"""Reading and writing the pipeline's tables as Parquet files: validated both ways, written atomically.

The only module that reads or writes table files. A table is checked against its schema, written to a hidden
temporary file in the target folder, fsynced and renamed over the target (`os.replace`); reads check it again,
except a file this process checked and wrote itself and that is unchanged since. A stage writing several
tables uses `write_tables`, which checks them all (schemas, and the disk budget: io/disk_budget.py) before
writing any.
Design notes: docs/architecture.md §11 (agent_core/io/tables.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import schemas
from agent_core.io.atomic import atomic_file
from agent_core.io.disk_budget import ensure_room

COMPRESSION = "zstd"
_WRITTEN: dict[str, tuple[str, tuple]] = {}  # path -> (table name, _stat_key) of what this process checked and wrote


class TableReadError(ValueError):
    """A table file exists but is not readable Parquet (truncated, corrupted, not Parquet)."""

    def __init__(self, table_name: str, path: str, reason: str):
        self.table_name, self.path = table_name, path
        reason = " ".join(reason.split())  # Arrow's reasons span lines; keep the error to one
        super().__init__(f"cannot read {table_name} table at {path}: {reason}")


def write_table(table_name: str, data: pa.Table | Iterable[Mapping[str, Any]], uri: str | os.PathLike) -> str:
    """Validate `data` as table `table_name` and write it to `uri` atomically; return the uri.

    data: an Arrow table, or rows (dicts keyed by column name), converted with the table's schema.
    A validation failure raises `schemas.TableValidationError`, too little free disk for the table and
    the run's margin `disk_budget.DiskBudgetError`; either writes nothing.
    """
    path = _local_path(uri)  # a remote uri fails before the data is looked at
    _write_checked(table_name, _checked(table_name, data), path)
    return str(uri)


def write_tables(*tables: tuple[str, pa.Table | Iterable[Mapping[str, Any]], str | os.PathLike]) -> list[str]:
    """Write several (table_name, data, uri) tables, all validated before the first is written: a
    stage whose second table is bad must not leave its first behind. Returns the uris."""
    checked = [(name, _checked(name, data), _local_path(uri)) for name, data, uri in tables]
    if checked:  # the room for all of them, before the first: a stage's tables come whole or not at all
        ensure_room(checked[0][2], sum(table.nbytes for _, table, _ in checked),
                    " and ".join(f"{name} table" for name, _, _ in checked))
    for name, table, path in checked:
        _write_checked(name, table, path)
    return [str(uri) for _, _, uri in tables]


def _checked(table_name: str, data: pa.Table | Iterable[Mapping[str, Any]]) -> pa.Table:
    if not isinstance(data, pa.Table):
        data = schemas.table_from_rows(table_name, data)
    return schemas.validate(table_name, data)


def _write_checked(table_name: str, table: pa.Table, path: Path) -> None:
    # Arrow's in-memory size: about the Parquet file before compression, known before a byte is written
    ensure_room(path, table.nbytes, f"{table_name} table")
    with atomic_file(path, failpoint_prefix=f"write_table:{path.name}") as sink:
        pq.write_table(table, sink, compression=COMPRESSION, write_page_checksum=True)
    _WRITTEN[str(path.resolve())] = (table_name, _stat_key(os.stat(path)))


def _stat_key(stat: os.stat_result) -> tuple:
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def read_table(table_name: str, uri: str | os.PathLike) -> pa.Table:
    """Read and validate table `table_name` from `uri`.

    Raises FileNotFoundError (no file), TableReadError (not readable Parquet) or
    schemas.TableValidationError (readable, but breaks the schema; the message names the file).
    """
    schemas.table_spec(table_name)  # an unknown name fails before the disk is touched
    path = _local_path(uri)
    if not path.is_file():
        raise FileNotFoundError(f"no {table_name} table at {path}")
    try:
        # ParquetFile reads just this file: no hive partition columns from `iteration=<k>` folders.
        with open(path, "rb") as handle, pq.ParquetFile(handle, page_checksum_verification=True) as parquet_file:
            table = parquet_file.read()
            read_key = _stat_key(os.fstat(handle.fileno()))  # of the very file read (module docstring)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as error:  # the last: a damaged footer's column names
        raise TableReadError(table_name, str(path), str(error)) from None
    if _WRITTEN.get(str(path.resolve())) == (table_name, read_key):
        spec = schemas.table_spec(table_name)
        if table.schema.equals(spec.arrow_schema):  # as written; else conform it below
            return table
    try:
        return schemas.validate(table_name, table)
    except schemas.TableValidationError as error:
        raise error.with_source(str(path)) from None


def table_exists(uri: str | os.PathLike) -> bool:
    """True when the table file is in place (complete, as every table is written atomically; whether
    the stage that wrote it finished is its manifest's to say: io/manifests.py)."""
    return _local_path(uri).is_file()


STEP_KEY = ("episode_id", "step_idx")


def join_steps(steps_uri: str | os.PathLike, steps_columns: Sequence[str], table_name: str,
               uri: str | os.PathLike, columns: Sequence[str], every_step: bool = True) -> list[dict[str, Any]]:
    """The one join of the steps table with a per-step table (rewards, advantages) on
    (episode_id, step_idx): one dict per step, in the steps table's order, holding `steps_columns`
    of the step and `columns` of its row in `table_name` at `uri`.

    every_step: ValueError naming up to ten steps that have no row in the other table; False (the
    advantages table, which holds only the steps trained on): those steps are left out, and a row of
    the other table with no step is the error. Done in Python, since Arrow's hash join drops list
    columns (token ids, log-probs, advantages).
    """
    steps = read_table("steps", steps_uri).select(list(dict.fromkeys([*STEP_KEY, *steps_columns]))).to_pylist()
    other = read_table(table_name, uri).select(list(dict.fromkeys([*STEP_KEY, *columns]))).to_pylist()
    by_key = {(row["episode_id"], row["step_idx"]): row for row in other}
    if every_step:
        missing = [f"{s['episode_id']}/{s['step_idx']}" for s in steps if (s["episode_id"], s["step_idx"]) not in by_key]
    else:
        step_keys = {(s["episode_id"], s["step_idx"]) for s in steps}
        missing = [f"{e}/{k}" for e, k in by_key if (e, k) not in step_keys]
        steps = [s for s in steps if (s["episode_id"], s["step_idx"]) in by_key]
    if missing and every_step:
        raise ValueError(f"{uri}: no {table_name} row for steps {missing[:10]} ({len(missing)} steps)")
    if missing:
        raise ValueError(f"{uri}: {table_name} rows {missing[:10]} have no row in {steps_uri} ({len(missing)} rows)")
    return [{**step, **{name: by_key[step["episode_id"], step["step_idx"]][name] for name in columns}} for step in steps]


def rows_of(instances: Iterable[Any], **constant_columns: Any) -> list[dict[str, Any]]:
    """Dataclass instances as rows for `write_table`, plus columns every row shares, e.g.
    `rows_of(step_records, run_id="r1", iteration=0)`.

    Shallow on purpose: `dataclasses.asdict` deep-copies every list item, which for token-id
    lists costs a Python call per token.
    """
    rows = []
    for instance in instances:
        if not dataclasses.is_dataclass(instance) or isinstance(instance, type):
            raise TypeError(f"rows_of takes dataclass instances, got {type(instance).__name__}")
        row = {field.name: getattr(instance, field.name) for field in dataclasses.fields(instance)}
        clash = constant_columns.keys() & row.keys()
        if clash:
            raise ValueError(f"rows_of: {', '.join(sorted(clash))} given as a constant column and also a field of {type(instance).__name__}")
        rows.append({**constant_columns, **row})
    return rows


def _local_path(uri: str | os.PathLike) -> Path:
    text = os.fspath(uri)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise ValueError(f"unsupported table location {text!r}: only local paths (or file:// URIs) are supported")
    return Path(text)
