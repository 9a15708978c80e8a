"""Where `agentr1 query --output` may write a result, and writing it (issue 39 item 6).

A result never lands among the tables of ANY data root, not only the one queried: it would
replace a table, or become one. A folder is a data root when it holds `mlflow.db`, a run's
iteration folder (`runs/<id>/iteration=<k>/`), a dataset table (`datasets/<id>/prompts.parquet` or
`corpus.parquet`) or an evaluation (`evals/<id>/`); its tables are everything under its `runs/`,
`datasets/` and `evals/`. A path is checked with symlinks resolved, and each folder named
`runs`, `datasets` or `evals` on it is tested for being such a root's. An existing file is
replaced only with `--force`; a directory or a place that cannot be written is one line, before
the query runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from agent_core.io.atomic import atomic_file
from agent_core.io.query_files import DATASET_FILES, TABLE_FOLDERS

RESULT_SUFFIXES = (".csv", ".parquet")


def is_data_root(folder: Path) -> bool:
    """Whether `folder` looks like a data root (module doc): mlflow.db, a run's iteration folder, a
    dataset table or an evaluation."""
    folder = Path(folder)
    if (folder / "mlflow.db").exists() or any((folder / "evals").glob("*/")):
        return True
    if any(p.is_dir() for p in (folder / "runs").glob("*/iteration=*")):
        return True
    return any(any((folder / "datasets").glob(f"*/{name}")) for name in DATASET_FILES.values())


def _tables_around(target: Path, data_root: Path) -> Path | None:
    """The table folder (`<root>/runs`, `/datasets` or `/evals`) of a data root that `target` is in."""
    given = [(Path(data_root) / folder).resolve() for folder in TABLE_FOLDERS]
    for tables in given:
        if target.is_relative_to(tables):
            return tables
    for depth, part in enumerate(target.parts[:-1]):
        if part in TABLE_FOLDERS:
            folder = Path(*target.parts[: depth + 1])
            if is_data_root(folder.parent):
                return folder
    return None


def check_result_path(path: Path, data_root: Path, force: bool = False) -> None:
    """Refuse, before a query runs, a result path `write_result` cannot or must not write (ValueError,
    one line): an unknown suffix, a place among any data root's tables, an existing file without
    `force`, a directory, a place that cannot be written."""
    path = Path(path)
    _check_suffix(path)
    target = path.resolve()
    tables = _tables_around(target, data_root)
    if tables is not None:
        raise ValueError(f"refusing to write a result to {path}: it is inside {tables}, among the tables queries "
                         "read; write it outside any data root's runs/, datasets/ and evals/")
    if target.is_dir():
        raise ValueError(f"cannot write a result to {path}: it is a directory")
    if target.exists() and not force:
        raise ValueError(f"refusing to overwrite {path}: it exists; add --force to replace it")
    _check_writable(path, target)


def _check_writable(path: Path, target: Path) -> None:
    """Create and remove a hidden file where the result would go (its nearest existing folder)."""
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"cannot write a result to {path}: {folder} is not a directory")
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".agentr1-probe-", dir=folder)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(f"cannot write a result to {path}: {error.strerror or error} in {folder}") from None


def _check_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in RESULT_SUFFIXES:
        raise ValueError(f"cannot write a result to {path}: unknown suffix {path.suffix!r}; "
                         f"valid: {', '.join(RESULT_SUFFIXES)}")
    return suffix


def _nested_to_json(table: pa.Table) -> pa.Table:
    """CSV has no list or struct cells: write those columns as JSON text."""
    for index, field in enumerate(table.schema):
        if pa.types.is_nested(field.type):
            text = [None if v is None else json.dumps(v, default=str) for v in table.column(index).to_pylist()]
            table = table.set_column(index, pa.field(field.name, pa.string()), pa.array(text, pa.string()))
    return table


def write_result(table: pa.Table, path: Path) -> None:
    """Write a query result to `path` as CSV or Parquet, chosen by suffix; atomically (`atomic_file`),
    so a reader never sees half a file. A write that fails (disk full, removed folder) is a
    ValueError in one line."""
    path = Path(path)
    suffix = _check_suffix(path)
    try:
        with atomic_file(path, "wb") as sink:
            if suffix == ".csv":
                pa_csv.write_csv(_nested_to_json(table), sink)
            else:
                pq.write_table(table, sink)
    except OSError as error:
        raise ValueError(f"cannot write a result to {path}: {error.strerror or error}") from None
