"""Which files of a data root the read-only catalog reads (agent_core/io/query.py), and its snapshot folders.

Agent programs run with write access to their run's folder, so the folder is untrusted (issue 39):
- A view is made only for a KNOWN table name (`run_table_names`); any other `*.parquet` in a run
  (`costs.parquet` once crashed every query: the `costs` view already existed) is ignored with one
  `IgnoredFileWarning` naming it, and never stops the other views.
- A symlink is followed only to a table file of the same kind inside the same table folder of the
  root (`runs/`, `datasets/`, `evals/`, each resolved once: the root's owner may put one on
  another disk); one leading anywhere else is ignored with a warning, and DuckDB is handed the
  resolved file or a hard link of it, never a symlink (its `allowed_paths` would follow it).
- Each query's snapshot folder (`.query-<host>-<pid>-<random>`) names its owner; a killed
  query's folder is removed at the next query's start (`remove_stale_snapshots`), a live one's never.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa

import schemas
from agent_core.io.layout import DATASET_TABLES, RUN_TABLES
from agent_core.io.ledger import LEDGER_TABLE
from agent_core.io.readonly_sql import TableFile

_ITERATION_DIR = re.compile(r"^iteration=\d+$")
_SEED_DIR = re.compile(r"^seed=\d+$")
DATASET_FILES = {"dataset_prompts": "prompts.parquet", "corpus": "corpus.parquet"}
RUN_FOLDER_FILES = ("dev_eval_start.parquet",)  # what a run writes beside its iterations; no view reads it
TABLE_FOLDERS = ("runs", "datasets", "evals")
LEGACY_SNAPSHOT_AGE_S = 3600.0  # a `.query-*` folder without an owner (an earlier version's) older than this is stale


class IgnoredFileWarning(UserWarning):
    """A file among the tables that no view reads: an unknown name, or a symlink out of the tables."""


def _ignore(path: Path, why: str) -> None:
    warnings.warn(f"ignored {path}: {why}", IgnoredFileWarning, stacklevel=3)


def table_schemas() -> dict[str, pa.Schema]:
    return {name: spec.arrow_schema for name, spec in getattr(schemas, "TABLES", {}).items()}


def run_table_names() -> tuple[str, ...]:
    """The tables a run writes into `iteration=<k>/`: the run tables, `health` (the audit's), the
    ledger, every other table of `schemas.TABLES` that is not a dataset's or an eval's, and `dev_eval`."""
    names = dict.fromkeys((*RUN_TABLES, "health", LEDGER_TABLE))
    names.update(dict.fromkeys(n for n in table_schemas() if n not in DATASET_TABLES and n != "eval"))
    return (*names, "dev_eval")


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def _kept(path: Path, folder: Path, shape: tuple[re.Pattern | str, ...]) -> bool:
    """Whether `path` is a file whose real place (symlinks resolved) has `shape` (its parts below
    `folder`, resolved once; a string must equal the part, a pattern match it); else warned about."""
    try:
        real = path.resolve(strict=True)
        parts = real.relative_to(folder.resolve()).parts
    except (OSError, ValueError, RuntimeError):
        _ignore(path, f"a symlink out of {folder} (or an unreadable path): not followed")
        return False
    fits = len(parts) == len(shape) and all(
        not part.startswith(".") and (part == want if isinstance(want, str) else want.match(part))
        for part, want in zip(parts, shape))
    if not fits:
        _ignore(path, f"a symlink to another kind of file in {folder}: not followed")
        return False
    if not stat.S_ISREG(os.stat(real).st_mode):
        _ignore(path, "not a regular file")
        return False
    return True


def run_table_files(data_root: Path, run_id: str = "*") -> dict[str, list[Path]]:
    """Parquet files of each run table, by table name (sorted; hidden temp files left out; unknown
    names and symlinks out of `runs/` warned about and left out); of every run, or of `run_id` only."""
    data_root = Path(data_root)
    runs, names = data_root / "runs", run_table_names()
    # `health` (the audit's table) and the ledger are empty views until a run has written one
    files: dict[str, list[Path]] = {name: [] for name in names if name != "dev_eval"}
    for path in sorted(data_root.glob(f"runs/{run_id}/iteration=*/*.parquet")):
        if not (_visible(path, data_root) and _ITERATION_DIR.match(path.parent.name)):
            continue
        if path.stem not in names:
            _ignore(path, f"not a table of a run (those are {', '.join(names)})")
        elif _kept(path, runs, (re.compile(r".+"), _ITERATION_DIR, path.name)):
            files.setdefault(path.stem, []).append(path)
    for path in sorted(data_root.glob(f"runs/{run_id}/*.parquet")):
        if _visible(path, data_root) and path.name not in RUN_FOLDER_FILES:
            _ignore(path, "not a table of a run (a run's tables are in its iteration=<k>/ folders)")
    return files


def dataset_table_files(data_root: Path) -> dict[str, list[Path]]:
    """Parquet files of each dataset table, by view name (sorted; hidden folders left out)."""
    data_root = Path(data_root)
    return {name: [path for path in sorted(data_root.glob(f"datasets/*/{file_name}"))
                   if _visible(path, data_root) and _kept(path, data_root / "datasets", (re.compile(r".+"), file_name))]
            for name, file_name in DATASET_FILES.items()}


def eval_table_files(data_root: Path) -> dict[str, list[Path]]:
    """Parquet files of the `eval` table, every evaluation (sorted; hidden temp files left out)."""
    data_root = Path(data_root)
    shape = (re.compile(r".+"), re.compile(r".+"), _SEED_DIR, "eval.parquet")
    paths = sorted(data_root.glob("evals/*/*/seed=*/eval.parquet"))
    return {"eval": [p for p in paths if _visible(p, data_root) and _kept(p, data_root / "evals", shape)]}


def _linked(files: list[Path], folder: Path) -> list[TableFile]:
    """Hard links in `folder` to the real files of `files` (checked by the listing); a file whose
    link turns out not to be the file just resolved (a component swapped meanwhile) is left out;
    the resolved path itself where linking is refused (e.g. another filesystem)."""
    folder.mkdir(parents=True, exist_ok=True)
    linked = []
    for i, path in enumerate(files):
        link = folder / f"{i}.parquet"
        try:
            real = path.resolve(strict=True)
            seen = os.stat(real, follow_symlinks=False)
        except OSError:
            continue  # gone since it was listed
        try:
            os.link(real, link, follow_symlinks=False)
        except OSError:
            linked.append(TableFile(real, path))
            continue
        made = os.lstat(link)
        if (made.st_dev, made.st_ino) != (seen.st_dev, seen.st_ino) or not stat.S_ISREG(made.st_mode):
            link.unlink()
            _ignore(path, "it changed into something else while the query started: not read")
            continue
        linked.append(TableFile(link, path))
    return linked


def table_views(tables: dict[str, list[Path]], snapshot_dir: Path | None) -> dict[str, list[TableFile]]:
    """Each table's files as the catalog reads them: hard links in `snapshot_dir` (`_linked`), or
    without a snapshot the resolved files themselves (DuckDB is never handed a symlink)."""
    return {name: _linked(files, snapshot_dir / name) if snapshot_dir else [TableFile(p.resolve(), p) for p in files]
            for name, files in tables.items()}


@contextmanager
def snapshot(data_root: Path) -> Iterator[Path | None]:
    """A query's snapshot folder under `data_root` (`_snapshot_folder`; None where the root cannot be
    written), removed when the block ends."""
    folder = _snapshot_folder(Path(data_root))
    try:
        yield folder
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _owner_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def _snapshot_folder(data_root: Path) -> Path | None:
    """A private hidden folder under the data root, `.query-<host>-<pid>-<random>` (hidden: no
    listing ever reads it); None if the root cannot be written (a read-only share: queries then
    read the files themselves)."""
    try:
        return Path(tempfile.mkdtemp(prefix=f".query-{_owner_tag()}-{os.getpid()}-", dir=data_root))
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_snapshots(data_root: Path) -> list[Path]:
    """Remove the snapshot folders of queries that are gone (killed before they could): this host's
    whose process is dead, and owner-less ones (an earlier version's) untouched for an hour. Another
    host's are left (its pids say nothing here), so is a live query's. Returns what was removed."""
    removed, mine = [], re.compile(rf"^\.query-{re.escape(_owner_tag())}-(\d+)-")
    for folder in Path(data_root).glob(".query-*"):
        match = mine.match(folder.name)
        if match:
            stale = not _alive(int(match.group(1)))
        elif folder.name.count("-") == 1:  # `.query-<random>`: no owner recorded
            stale = time.time() - _mtime(folder) > LEGACY_SNAPSHOT_AGE_S
        else:
            stale = False
        if stale and folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _mtime(folder: Path) -> float:
    try:
        return folder.stat().st_mtime
    except OSError:
        return time.time()
