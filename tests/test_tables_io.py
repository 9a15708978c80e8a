"""Table files: validated on write and on read (not again a file this process validated and wrote, while
unchanged), written atomically, clear errors for bad files."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import schemas
from agent_core.io import tables
from test_schemas import rewards_rows, steps_rows


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_round_trip_keeps_rows_and_exact_schema(tmp_path):
    uri = tables.write_table("steps", steps_rows(), tmp_path / "steps.parquet")
    back = tables.read_table("steps", uri)
    assert back.schema == schemas.TABLES["steps"].arrow_schema
    assert back.to_pylist() == schemas.validate("steps", schemas.table_from_rows("steps", steps_rows())).to_pylist()
    assert _files(tmp_path) == ["steps.parquet"]  # no temporary file left behind


def test_bad_row_is_rejected_with_its_name_and_nothing_is_written(tmp_path):
    rows = rewards_rows()
    rows[4]["reward"] = float("inf")
    target = tmp_path / "iteration=0" / "rewards.parquet"
    with pytest.raises(schemas.TableValidationError) as caught:
        tables.write_table("rewards", rows, target)
    message = str(caught.value)
    assert "rewards" in message and "reward" in message and "ep-1/1" in message
    assert not target.exists()
    assert not target.parent.exists() or _files(target.parent) == []


def test_failed_write_keeps_the_old_table_and_removes_the_temporary(tmp_path, monkeypatch):
    target = tmp_path / "rewards.parquet"
    tables.write_table("rewards", rewards_rows(), target)
    before = target.read_bytes()

    def crash_mid_write(table, sink, **kwargs):
        sink.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(tables.pq, "write_table", crash_mid_write)
    rows = rewards_rows()
    rows[0].update(process_reward=-0.2, reward=-0.2)
    with pytest.raises(OSError, match="disk full"):
        tables.write_table("rewards", rows, target)
    assert target.read_bytes() == before
    assert _files(tmp_path) == ["rewards.parquet"]


def test_temporary_file_is_invisible_to_table_globs(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy_replace(source, destination):
        seen.append(Path(source).name)
        assert not list(tmp_path.glob("*.parquet"))  # the half-written file matches no table glob
        real_replace(source, destination)

    monkeypatch.setattr(tables.os, "replace", spy_replace)
    tables.write_table("steps", steps_rows(), tmp_path / "steps.parquet")
    assert len(seen) == 1 and seen[0].startswith(".") and not seen[0].endswith(".parquet")


def test_read_validates_a_file_written_by_other_code(tmp_path):
    table = schemas.table_from_rows("rewards", rewards_rows())
    rewards = table.column("reward").to_pylist()
    rewards[2] = float("nan")
    broken = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(rewards, pa.float64()))
    path = tmp_path / "rewards.parquet"
    pq.write_table(broken, path)
    with pytest.raises(schemas.TableValidationError) as caught:
        tables.read_table("rewards", path)
    assert str(path) in str(caught.value) and "ep-0/2" in str(caught.value)


@pytest.fixture()
def validations(monkeypatch) -> list[str]:
    """The tables schemas.validate checked, in order."""
    seen: list[str] = []
    real = schemas.validate

    def counted(name, data):
        seen.append(name)
        return real(name, data)

    monkeypatch.setattr(schemas, "validate", counted)
    return seen


def test_a_table_this_process_wrote_is_not_checked_again_on_read_unless_the_file_changed(tmp_path, validations):
    path = tmp_path / "rewards.parquet"
    tables.write_table("rewards", rewards_rows(), path)
    assert validations == ["rewards"]
    first = tables.read_table("rewards", path)
    assert validations == ["rewards"]  # the very file it checked and wrote
    assert first.schema.equals(schemas.table_spec("rewards").arrow_schema) and first.num_rows == len(rewards_rows())
    with pytest.raises(schemas.TableValidationError):  # read as another table: checked, and refused
        tables.read_table("steps", path)
    # replaced by other code (a new file) with a bad row: checked on read, and refused
    table = schemas.table_from_rows("rewards", rewards_rows())
    rewards = table.column("reward").to_pylist()
    rewards[2] = float("nan")
    pq.write_table(table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(rewards, pa.float64())),
                   path)
    with pytest.raises(schemas.TableValidationError, match="ep-0/2"):
        tables.read_table("rewards", path)


def test_a_table_edited_in_place_is_checked_again(tmp_path, validations):
    path = tmp_path / "rewards.parquet"
    tables.write_table("rewards", rewards_rows(), path)
    before = os.stat(path)
    with open(path, "r+b") as handle:  # same inode and size, a new modification time
        data = handle.read()
        handle.seek(0)
        handle.write(data)
    if os.stat(path).st_mtime_ns == before.st_mtime_ns:  # a clock coarser than this test: as a later write would
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert os.stat(path).st_ino == before.st_ino
    tables.read_table("rewards", path)
    assert validations == ["rewards", "rewards"]


def test_corrupt_file_error_names_the_path(tmp_path):
    path = tmp_path / "steps.parquet"
    tables.write_table("steps", steps_rows(), path)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(tables.TableReadError, match=str(path)):
        tables.read_table("steps", path)


def test_missing_file_and_unknown_table(tmp_path):
    with pytest.raises(FileNotFoundError, match="no steps table"):
        tables.read_table("steps", tmp_path / "steps.parquet")
    with pytest.raises(schemas.UnknownTableError, match="valid tables"):
        tables.read_table("step", tmp_path / "steps.parquet")
    assert not tables.table_exists(tmp_path / "steps.parquet")


def test_remote_uri_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="only local paths"):
        tables.write_table("steps", steps_rows(), "s3://bucket/steps.parquet")
    uri = "file://" + str(tmp_path / "steps.parquet")
    tables.write_table("steps", steps_rows(), uri)
    assert tables.table_exists(uri) and tables.read_table("steps", uri).num_rows == 6
