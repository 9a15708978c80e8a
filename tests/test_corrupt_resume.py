"""Corruption caught and named (issue 29): a table, checkpoint or optimizer state truncated, deleted or
replaced with garbage in a finished (or killed) run is found by its stage's manifest on resume; the
stage and what depends on it are redone, nothing else, and the run ends with the tables of an
undamaged run. A damaged table read anywhere fails with one line naming the file; a finished run is
not marked failed by a later command that changed none of its stages.

Each case damages a copy of one finished run (as the issue's tester did: a copied run's manifests
once named the intact originals) and resumes it in this process. Those cases are slow (a run to
damage costs 15-35 s); the default suite has the reading and status cases here, the manifest
cases of test_manifests.py (a copied folder, format-1 manifests, every kind of damage) and its
rerun test, which truncates a steps table of its finished run and resumes it.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from agent_core.io import tables
from agent_core.io.layout import RUN_TABLES, DataRoot
from agent_core.io.manifests import StageRecord
from agent_core.io.run_status import record_run_end, run_status
from flows.cli import main as cli_main
from kill_harness import RUN_ID, prefect_api_url, registered_iterations, run_cli, snapshot
from kill_harness import train_args as _train_args
from tasks.run_config import recording_end

# Tables with wall-clock columns (kill_harness.TIMING_COLUMNS): a redone stage writes them with other
# bytes, so they are compared row for row without those columns; every other file byte for byte. The
# ledger is all stage timings, rewritten after every iteration.
CLOCKED = ("steps.parquet", "train_metrics.parquet", "ledger.parquet")
# An iteration's stages in order; the audit reads its iteration's tables, so a redone rollout or train
# (whose tables hold wall-clock columns) redoes it (and a redone train its prune: it reads train's manifest), and the later iterations' audits whose baseline
# includes this iteration (audit.baseline_iterations), e.g. AUDIT_1 for iteration 0.
ITERATION_0 = [f"iteration=0/_manifests/{s}.json" for s in ("rollout", "label_rewards", "compute_advantages",
                                                             "train", "log_iteration", "audit", "prune")]
AUDIT_1 = "iteration=1/_manifests/audit.json"


def train_args() -> list[str]:
    """The kill tests' run, keeping every iteration's files: damaging iteration 0's checkpoint or
    optimizer state needs them there (retention's own resume is tests/test_kill_resume.py's)."""
    return [*_train_args(), "--set", "checkpoints.keep_all=true"]


def _damage(path: Path, how: str) -> None:
    if path.is_dir():  # a whole checkpoint folder
        shutil.rmtree(path)
        return
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":  # the same size: only the content hash tells
        path.write_bytes(bytes(random.Random(len(data)).randrange(256) for _ in data))
    else:
        path.unlink()


def _manifest_times(root: Path) -> dict[str, int]:
    run_dir = DataRoot(root).run(RUN_ID).run_dir
    return {p.relative_to(run_dir).as_posix(): p.stat().st_mtime_ns for p in run_dir.glob("**/_manifests/*.json")}


def _files(root: Path) -> dict[str, bytes]:
    """Every table, checkpoint and optimizer file of the run and of its dataset."""
    patterns = ("runs/*/iteration=*/*.parquet", "runs/*/iteration=*/*.pt", "runs/*/*/model.safetensors",
                "runs/*/iteration=*/*/*.safetensors", "datasets/*/*.parquet")
    return {p.relative_to(root).as_posix(): p.read_bytes() for pattern in patterns for p in root.glob(pattern)}


def _finished(tmp_path_factory, name: str, *overrides: str):
    """A finished run (built in this process): its root, tables, files and manifest times."""
    root = tmp_path_factory.mktemp(name)
    args = [*train_args(), *[a for o in overrides for a in ("--set", o)], "--data-root", str(root)]
    assert cli_main(args) == 0
    return root, snapshot(root), _files(root), _manifest_times(root)


@pytest.fixture(scope="module")
def one_iteration(tmp_path_factory):
    return _finished(tmp_path_factory, "one", "iterations=1")


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    return _finished(tmp_path_factory, "two")


def _damage_and_resume(finished, tmp_path: Path, target: str, how: str, caplog) -> tuple[Path, list[str]]:
    """Damage `target` (relative to the run, or `dataset/<file>`) in a copy of the finished run and
    resume the copy; (the copy, the manifests the resume rewrote). Checks the end state."""
    root, rows, files, times = finished
    copy = tmp_path / "copy"  # a path of its own per test: MLflow keeps each store's database open
    shutil.copytree(root, copy)
    run = DataRoot(copy).run(RUN_ID)
    path = next(copy.glob("datasets/*")) / target.split("/", 1)[1] if target.startswith("dataset/") else run.run_dir / target
    _damage(path, how)
    assert cli_main(["resume", "--run-id", RUN_ID, "--data-root", str(copy)]) == 0
    after = _manifest_times(copy)
    redone = sorted(name for name in after if after[name] != times.get(name))
    assert snapshot(copy) == rows  # every table row for row, every checkpoint file byte for byte
    got = _files(copy)
    assert got.keys() == files.keys()
    assert [name for name in files if got[name] != files[name] and not name.endswith(CLOCKED)] == []
    assert run_status(run).status == "finished"
    assert rows["registered"] == [k for k in range(len(rows)) if f"{k}/steps" in rows]  # kept: one per iteration
    if target != "dataset/corpus.parquet" or how != "delete":  # a missing dataset table is simply written again
        named = (path, path.parent)  # the damaged file, or the checkpoint folder it is in
        assert any(str(p) in r.getMessage() for r in caplog.records if r.levelname == "WARNING" for p in named), \
            "no warning named the damaged output"
    return copy, redone


@pytest.mark.slow  # ~15 s on a quiet machine (the run, then a resume), 35 s on a busy one
def test_a_truncated_steps_table_redoes_its_rollout_and_what_depends_on_it(one_iteration, tmp_path, caplog):
    """The issue's case: rollout said "already complete", log_iteration crashed, the run became failed."""
    _, redone = _damage_and_resume(one_iteration, tmp_path, "iteration=0/steps.parquet", "truncate", caplog)
    assert redone == sorted(ITERATION_0)


# What each damage redoes, in a 2-iteration run (configs/tiny.yaml). A redone stage whose outputs come
# out byte for byte the same lets the stages that read them be skipped; the clocked tables do not,
# so a redone rollout or train also redoes the stages that read its steps or train_metrics.
CASES = {
    ("iteration=0/prompts.parquet", "truncate"): ["iteration=0/_manifests/prepare_data.json"],
    ("iteration=0/prompts.parquet", "garbage"): ["iteration=0/_manifests/prepare_data.json"],
    ("iteration=0/steps.parquet", "garbage"): [*ITERATION_0, AUDIT_1],
    ("iteration=0/steps.parquet", "delete"): [*ITERATION_0, AUDIT_1],
    ("iteration=1/steps.parquet", "truncate"): [s.replace("iteration=0", "iteration=1") for s in ITERATION_0],
    ("iteration=0/rewards.parquet", "truncate"): ["iteration=0/_manifests/label_rewards.json"],
    ("iteration=0/rewards.parquet", "delete"): ["iteration=0/_manifests/label_rewards.json"],
    ("iteration=0/advantages.parquet", "garbage"): ["iteration=0/_manifests/compute_advantages.json"],
    ("iteration=0/advantages.parquet", "truncate"): ["iteration=0/_manifests/compute_advantages.json"],
    ("iteration=0/train_metrics.parquet", "garbage"): [*ITERATION_0[3:], AUDIT_1],
    ("iteration=1/train_metrics.parquet", "delete"): [s.replace("iteration=0", "iteration=1") for s in ITERATION_0[3:]],
    ("iteration=0/checkpoint/model.safetensors", "truncate"): [*ITERATION_0[3:], AUDIT_1],
    ("iteration=0/checkpoint/model.safetensors", "garbage"): [*ITERATION_0[3:], AUDIT_1],
    ("iteration=0/checkpoint", "delete"): [*ITERATION_0[3:], AUDIT_1],
    ("iteration=0/optimizer.pt", "garbage"): [*ITERATION_0[3:], AUDIT_1],
    ("iteration=0/optimizer.pt", "delete"): [*ITERATION_0[3:], AUDIT_1],
    ("initial_policy/model.safetensors", "truncate"): ["_manifests/init_policy.json"],
    # not under a manifest: written again when no longer Parquet, the same bytes, so no run sees a change
    ("dataset/prompts.parquet", "garbage"): [],
    ("dataset/corpus.parquet", "truncate"): [],
    ("dataset/corpus.parquet", "delete"): [],
}


@pytest.mark.slow
@pytest.mark.parametrize("target,how", list(CASES), ids=[f"{t}-{h}" for t, h in CASES])
def test_each_damaged_output_redoes_exactly_its_stage_and_what_depends_on_it(two_iterations, tmp_path, caplog,
                                                                             target, how):
    _, redone = _damage_and_resume(two_iterations, tmp_path, target, how, caplog)
    assert redone == sorted(CASES[target, how])


@pytest.mark.slow
def test_a_killed_run_with_a_damaged_table_resumes_to_the_undamaged_run(two_iterations, tmp_path):
    """Killed as iteration 1's training starts, then iteration 0's steps truncated: the resume redoes
    iteration 0 from its rollout, finishes iteration 1, and ends with the uninterrupted run's tables."""
    _, rows, files, _ = two_iterations
    root = tmp_path / "killed"
    api = prefect_api_url()
    code, output = run_cli(train_args(), root, failpoint="stage:train:start@2", prefect_api=api)
    assert code == -9, output[-2000:]
    run = DataRoot(root).run(RUN_ID)
    killed_times = _manifest_times(root)
    assert "iteration=1/_manifests/compute_advantages.json" in killed_times
    assert "iteration=1/_manifests/train.json" not in killed_times
    _damage(Path(run.table_uri(0, "steps")), "truncate")
    code, output = run_cli(["resume", "--run-id", RUN_ID], root, prefect_api=api)
    assert code == 0, output[-3000:]
    assert "iteration 0 rollout: redoing the stage, its outputs are missing or damaged" in output
    after = _manifest_times(root)
    assert sorted(n for n in after if after[n] != killed_times.get(n)) == sorted(
        [*ITERATION_0, "iteration=1/_manifests/train.json", "iteration=1/_manifests/log_iteration.json", AUDIT_1,
         "iteration=1/_manifests/prune.json"])
    assert snapshot(root) == rows
    got = _files(root)
    assert [name for name in files if got.get(name) != files[name] and not name.endswith(CLOCKED)] == []
    assert run_status(run).status == "finished" and registered_iterations(root) == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("target,how", [("iteration=0/critic/model.safetensors", "truncate"),
                                        ("iteration=0/critic_optimizer.pt", "garbage"),
                                        ("initial_critic/model.safetensors", "delete")])
def test_a_damaged_critic_redoes_its_stage(tmp_path_factory, tmp_path, caplog, target, how):
    finished = _critic_run(tmp_path_factory)
    _, redone = _damage_and_resume(finished, tmp_path, target, how, caplog)
    expected = ["_manifests/init_critic.json"] if target.startswith("initial_critic") else ITERATION_0[3:]
    assert redone == sorted(expected)


_CRITIC_RUN: list = []


def _critic_run(tmp_path_factory):
    if not _CRITIC_RUN:  # built once for the three cases (a module fixture would build it for every run of the file)
        _CRITIC_RUN.append(_finished(tmp_path_factory, "critic", "iterations=1", "algorithm.estimator=gae"))
    return _CRITIC_RUN[0]


# ---- a damaged table read anywhere: one line naming the file ------------------------------------


def _corpus(path: Path) -> list[dict]:
    rng = random.Random(3)  # letters and spaces: text that compresses a little, as real text does
    rows = [{"doc_id": f"d{i}", "title": "t", "text": "".join(rng.choice("abcdefghij ") for _ in range(400))}
            for i in range(50)]
    tables.write_table("corpus", rows, path)
    return rows


def _refused(path: Path) -> str:
    with pytest.raises(tables.TableReadError) as caught:
        tables.read_table("corpus", path)
    message = str(caught.value)
    assert message.startswith(f"cannot read corpus table at {path}: ") and "\n" not in message
    return message


def test_a_damaged_footer_fails_naming_the_file_not_with_a_decode_error(tmp_path):
    """Bytes of a column name in the footer no longer UTF-8: pyarrow raised a bare UnicodeDecodeError."""
    path = tmp_path / "corpus.parquet"
    _corpus(path)
    data = path.read_bytes()
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")  # the file ends: footer, its length, "PAR1"
    at = data.index(b"doc_id", footer)  # the schema's name of the column
    path.write_bytes(data[:at] + b"\xff\xfe" + data[at + 2:])
    _refused(path)


def test_page_checksums_catch_a_changed_byte_inside_the_data(tmp_path):
    """Tables are written with page checksums and read verifying them: a byte changed inside a data
    page leaves a valid file that read as other text before; now it is refused."""
    path = tmp_path / "corpus.parquet"
    _corpus(path)
    column = pq.read_metadata(path).row_group(0).column(2)  # text
    damaged = bytearray(path.read_bytes())
    damaged[(column.dictionary_page_offset or column.data_page_offset) + column.total_compressed_size // 2] ^= 0x01
    path.write_bytes(bytes(damaged))
    assert "CRC checksum verification failed" in _refused(path)


def test_every_damaged_table_fails_with_one_line_naming_it(tmp_path):
    """Truncations, changed bytes and overwritten runs of bytes, 120 of them: each refused as a
    TableReadError naming the file (or, damage in a part no reader uses, the same rows)."""
    clean = tmp_path / "corpus.parquet"
    rows, data, rng = _corpus(clean), clean.read_bytes(), random.Random(29)
    refused = 0
    for trial in range(120):
        damaged = bytearray(data)
        if trial % 3 == 0:
            damaged = damaged[: rng.randrange(len(damaged))]
        elif trial % 3 == 1:
            for _ in range(rng.randint(1, 20)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        else:
            start = rng.randrange(len(damaged))
            damaged[start:start + 200] = bytes(rng.randrange(256) for _ in damaged[start:start + 200])
        path = tmp_path / f"t{trial}" / "corpus.parquet"
        path.parent.mkdir()
        path.write_bytes(bytes(damaged))
        try:
            assert tables.read_table("corpus", path).to_pylist() == rows
        except tables.TableReadError as error:
            assert str(error).startswith(f"cannot read corpus table at {path}: ") and "\n" not in str(error)
            refused += 1
    assert refused >= 100


# ---- the run's recorded end ---------------------------------------------------------------------


@pytest.fixture
def finished_run(tmp_path):
    run = DataRoot(tmp_path).run("r1")
    run.run_dir.mkdir(parents=True)
    record_run_end(run, "finished")
    return run


def test_a_finished_run_stays_finished_when_a_later_command_fails_without_committing(finished_run, caplog):
    with pytest.raises(tables.TableReadError):
        with recording_end(finished_run):
            raise tables.TableReadError("steps", "/x/steps.parquet", "No magic bytes")
    assert run_status(finished_run).status == "finished"
    assert "run r1 stays finished: this command changed none of its stages" in caplog.text


def test_a_later_command_that_committed_a_stage_and_then_failed_marks_the_run_failed(finished_run, tmp_path):
    output = tmp_path / "out.txt"
    output.write_text("redone")
    with pytest.raises(RuntimeError):
        with recording_end(finished_run):
            StageRecord(finished_run.run_dir / "_manifests" / "s.json", "s", {}, {}).commit({"out": output})
            raise RuntimeError("boom")
    status = run_status(finished_run)
    assert (status.status, status.detail) == ("failed", "RuntimeError: boom")


def test_a_damaged_status_record_reads_as_killed_not_a_crash(finished_run):
    finished_run.status_path.write_bytes(b"\xff{not json")
    assert run_status(finished_run).status == "killed"
    finished_run.status_path.write_text(json.dumps(["a list"]))
    assert run_status(finished_run).status == "killed"


def test_table_names_cover_the_run_tables():
    """The cases above damage every kind of run table (a new table must get a case)."""
    damaged = {Path(target).stem for target, _ in CASES if target.endswith(".parquet") and "dataset" not in target}
    assert damaged == set(RUN_TABLES)
