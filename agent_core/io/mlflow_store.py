"""The MLflow SQLite store of a data root as a file: created whole, and re-rooted when the data root has moved
(docs/architecture.md §8).

MLflow stores artifact locations as absolute URIs, so a moved or copied data root (`<root>/mlflow.db` beside
`<root>/mlartifacts/`) names the old place; `reroot_store` rewrites that prefix on open, in one transaction. A
store whose artifact root is not beside it is left alone. No mlflow import: this runs before the store opens.
Design notes: docs/architecture.md §11 (agent_core/io/mlflow_store.py).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

SQLITE_PREFIX = "sqlite:///"
# (table, column) of every absolute artifact location MLflow 3.17's SQLAlchemy store keeps.
LOCATION_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
    ("logged_models", "artifact_location"),
)
_BUSY_TIMEOUT_S = 60.0


def sqlite_store_path(tracking_uri: str) -> Path | None:
    """The store file of a `sqlite:///` tracking URI; None for any other store."""
    return Path(tracking_uri.removeprefix(SQLITE_PREFIX)) if tracking_uri.startswith(SQLITE_PREFIX) else None


def create_sqlite_store(path: Path, create_schema: Callable[[str], object]) -> None:
    """Create a new SQLite store whole or not at all: MLflow migrates a fresh database in ~2.5 s, and
    a process killed meanwhile would leave a half-migrated file no later run can open. So the schema
    is built (`create_schema(tracking_uri)`) in a hidden temporary file and hard-linked into place
    (`link` fails if a concurrent process got there first: its store is kept, ours dropped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return
    temp = path.with_name(f".{path.name}.{os.getpid()}-{time.time_ns()}.tmp")
    try:
        create_schema(f"{SQLITE_PREFIX}{temp.resolve()}")
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
    finally:
        temp.unlink(missing_ok=True)


@dataclass(frozen=True)
class _Location:
    """An artifact location as MLflow stored it: a file URI or a plain absolute path."""

    text: str
    path: Path
    is_uri: bool

    @classmethod
    def parse(cls, text: str | None) -> "_Location | None":
        if not text:
            return None
        if text.startswith("file:"):
            parsed = urlparse(text)
            if parsed.netloc not in ("", "localhost"):
                return None
            return cls(text, Path(unquote(parsed.path)), True)
        return cls(text, Path(text), False) if text.startswith("/") else None

    def moved_to(self, path: Path) -> str:
        """The same kind of location (URI or path) for `path`."""
        return path.as_uri() if self.is_uri else str(path)


def _local_path(location: str | Path) -> Path | None:
    """A folder given as a path (relative ones too) or a file URI; None for remote locations."""
    text = str(location)
    if isinstance(location, Path) or not ("://" in text or text.startswith("file:")):
        return Path(text).resolve()
    parsed = _Location.parse(text)
    return parsed.path if parsed is not None else None


def _stale_prefixes(db: sqlite3.Connection, artifact_root: Path) -> dict[str, str]:
    """old prefix -> new prefix, for each experiment whose artifact root has the store's artifact
    folder name but another parent than the store's folder."""
    moves = {}
    for (text,) in db.execute("SELECT DISTINCT artifact_location FROM experiments"):
        location = _Location.parse(text)
        if location is None or location.path.name != artifact_root.name or location.path == artifact_root:
            continue
        new = location.moved_to(artifact_root)
        if new != location.text:
            moves[location.text] = new
    return moves


def _columns(db: sqlite3.Connection) -> list[tuple[str, str]]:
    present = []
    for table, column in LOCATION_COLUMNS:
        names = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}  # noqa: S608 (constants)
        if column in names:
            present.append((table, column))
    return present


def _rewrite(db: sqlite3.Connection, old: str, new: str) -> int:
    """Replace the prefix `old` (whole path components only) by `new`; returns rows changed.
    Compared with substr, not LIKE: a path may hold `%` and `_`."""
    changed = 0
    for table, column in _columns(db):
        changed += db.execute(
            f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608 (constants)
            f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
            (new, len(old) + 1, old, len(old) + 1, old + "/"),
        ).rowcount
    return changed


def reroot_store(tracking_uri: str, artifact_root: str | Path) -> int:
    """Rewrite the artifact locations of a moved or copied data root's store to where it is now
    (module docstring); returns the number of values rewritten (0: nothing had moved, nothing
    written). A no-op unless `tracking_uri` is an existing SQLite file and `artifact_root` (a
    path or file URI) is a folder beside it."""
    store = sqlite_store_path(tracking_uri)
    root = _local_path(artifact_root)
    if store is None or root is None or not store.is_file():
        return 0
    store, root = store.resolve(), root.resolve()
    if root.parent != store.parent:
        return 0
    with closing(sqlite3.connect(store, timeout=_BUSY_TIMEOUT_S, isolation_level=None)) as db:
        if not _has_experiments_table(db) or not _stale_prefixes(db, root):
            return 0  # the common case: read only, nothing locked
        db.execute("BEGIN IMMEDIATE")  # found again under the write lock: a concurrent opener may have done it
        try:
            changed = sum(_rewrite(db, old, new) for old, new in _stale_prefixes(db, root).items())
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    return changed


def _has_experiments_table(db: sqlite3.Connection) -> bool:
    found = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'experiments'").fetchone()
    return found is not None
