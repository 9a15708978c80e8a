"""Stage manifests and resume: when a stage counts as complete, and what a rerun redoes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent_core.config import TrainerConfig
from agent_core.failpoints import TRACE_ENV, _selects, failpoint
from agent_core.io.layout import DataRoot
from agent_core.io.tombstones import read_tombstone
from agent_core.io.manifests import ABSENT, ManifestError, StageRecord, fingerprint, params_hash, read_manifest
from agent_core.validation import load_config
from flows.train import train
from kill_harness import snapshot

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def stage(tmp_path):
    """A finished stage: one input file, one output file and one output folder, committed."""
    source = tmp_path / "in.txt"
    source.write_text("input v1")
    out_file, out_dir = tmp_path / "out.parquet", tmp_path / "checkpoint"
    out_file.write_text("table")
    out_dir.mkdir()
    (out_dir / "model.safetensors").write_text("weights")

    def record(params=None, inputs=None):
        return StageRecord(tmp_path / "_manifests" / "s.json", "s", inputs or {"source": source},
                           params if params is not None else {"cfg": TrainerConfig(), "seed": 1})

    record().commit({"table": out_file, "model": out_dir})
    return record, source, out_file, out_dir


def test_a_committed_stage_is_complete_with_the_same_inputs_and_settings(stage):
    record, _, out_file, out_dir = stage
    assert record().completed() == {"table": str(out_file), "model": str(out_dir)}


def _damage(path: Path, how: str) -> None:
    """Damage a file in place as a failing disk or a stray command would."""
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":  # the same size, so only the content hash can tell
        stat = path.stat()
        path.write_bytes(bytes((b + 1) % 256 for b in data))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    else:
        path.unlink()


@pytest.mark.parametrize("change", ["params", "config field", "input content", "input gone", "output edited",
                                    "output deleted", "file added to the output folder", "output truncated",
                                    "output garbage of the same size", "checkpoint file truncated",
                                    "checkpoint file garbage", "checkpoint file deleted"])
def test_any_change_to_what_the_stage_read_or_wrote_makes_it_run_again(stage, change):
    record, source, out_file, out_dir = stage
    params = {"cfg": TrainerConfig(), "seed": 1}
    if change == "params":
        params["seed"] = 2
    elif change == "config field":
        params["cfg"] = TrainerConfig(lr=1e-5)
    elif change == "input content":
        source.write_text("input v2")
    elif change == "input gone":
        source.unlink()
    elif change == "output edited":
        out_file.write_text("table, edited by hand")
    elif change == "output deleted":
        out_file.unlink()
    elif change.startswith("output "):
        _damage(out_file, change.split()[1])
    elif change.startswith("checkpoint file "):
        _damage(out_dir / "model.safetensors", change.split()[2])
    else:
        (out_dir / "extra.bin").write_text("x")
    assert record(params).completed() is None


@pytest.mark.parametrize("how", ["truncated", "garbage", "deleted"])
def test_check_names_each_damaged_output_and_what_is_wrong(stage, how):
    record, _, out_file, _ = stage
    _damage(out_file, how)
    check = record().check()
    assert check.outputs is None and check.reason == "outputs missing or damaged"
    problem = {"truncated": "2 bytes, 5 recorded", "garbage": "content differs", "deleted": "missing"}[how]
    assert len(check.damaged) == 1 and check.damaged[0].startswith(f"table ({out_file}): {problem}")


def test_outputs_are_stored_relative_to_the_manifest_owner_with_their_sizes(stage, tmp_path):
    record, *_ = stage
    stored = json.loads((tmp_path / "_manifests" / "s.json").read_text())
    assert stored["version"] == 2 and stored["outputs"] == {"table": "out.parquet", "model": "checkpoint"}
    assert stored["output_sizes"] == {"table": 5, "model": 7}
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere.bin"
    outside.write_text("x")
    StageRecord(tmp_path / "_manifests" / "t.json", "t", {}, {}).commit({"out": outside})
    assert json.loads((tmp_path / "_manifests" / "t.json").read_text())["outputs"] == {"out": str(outside)}


def test_a_copied_folder_checks_its_own_outputs_not_those_at_the_old_place(stage, tmp_path):
    """The issue's case: in a copy, a damaged table passed as complete because the manifest named the
    intact original. Now the copy's own files are checked, and returned."""
    copy = tmp_path.parent / f"{tmp_path.name}-copy"
    shutil.copytree(tmp_path, copy)
    manifest = copy / "_manifests" / "s.json"
    record = StageRecord(manifest, "s", {"source": copy / "in.txt"}, {"cfg": TrainerConfig(), "seed": 1})
    assert record.completed() == {"table": str(copy / "out.parquet"), "model": str(copy / "checkpoint")}
    _damage(copy / "out.parquet", "truncated")
    assert record.completed() is None
    assert stage[0]().completed() is not None  # the original is intact and still complete


def test_a_relative_data_root_gets_its_outputs_back_in_the_form_the_stage_gave_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("data/_manifests").mkdir(parents=True)
    Path("data/out.parquet").write_text("table")
    record = StageRecord(Path("data/_manifests/s.json"), "s", {}, {})
    record.commit({"table": "data/out.parquet"})
    assert record.completed() == {"table": "data/out.parquet"}


@pytest.mark.parametrize("intact", [True, False])
def test_a_format_1_manifest_with_absolute_paths_is_re_rooted_where_it_is_now(tmp_path, intact):
    """Manifests written before outputs were relative: an absolute path of the old place is read
    under the manifest's current folder, so a moved run resumes and a damaged copy is redone."""
    old, new = tmp_path / "old" / "runs" / "r" / "iteration=0", tmp_path / "new" / "runs" / "r" / "iteration=0"
    for folder in (old, new):
        (folder / "_manifests").mkdir(parents=True)
        (folder / "steps.parquet").write_text("steps")
    record = StageRecord(new / "_manifests" / "rollout.json", "rollout", {}, {})
    (new / "_manifests" / "rollout.json").write_text(json.dumps({
        "version": 1, "stage": "rollout", "params_hash": record.params_hash, "inputs": {}, "metrics": {},
        "outputs": {"steps": str(old / "steps.parquet")},
        "output_fingerprints": {"steps": fingerprint(old / "steps.parquet")}}))
    if not intact:
        _damage(new / "steps.parquet", "garbage")
    assert record.completed() == ({"steps": str(new / "steps.parquet")} if intact else None)
    assert read_manifest(new / "_manifests" / "rollout.json").outputs == {"steps": str(new / "steps.parquet")}


def test_a_new_process_hashes_the_outputs_again(stage, tmp_path):
    """The hash cache lives in one process: a resume (a new process) re-reads every output, even one
    damaged so that its size and modification time are what they were."""
    record, _, out_file, _ = stage
    stat = out_file.stat()
    out_file.write_bytes(b"TABLE")
    os.utime(out_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    code = ("import sys; from agent_core.io.manifests import StageRecord; from agent_core.config import TrainerConfig;"
            f"r = StageRecord({str(tmp_path / '_manifests' / 's.json')!r}, 's', {{'source': {str(tmp_path / 'in.txt')!r}}},"
            " {'cfg': TrainerConfig(), 'seed': 1}); c = r.check(); print(c.reason, c.damaged)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert "outputs missing or damaged" in result.stdout and "content differs" in result.stdout


def test_hidden_temporaries_do_not_change_a_folder_fingerprint(stage):
    record, _, _, out_dir = stage
    before = fingerprint(out_dir)
    (out_dir / ".model.safetensors.tmp-0a1b2c3d").write_text("a killed writer's leftover")
    assert fingerprint(out_dir) == before and record().completed() is not None


def test_fingerprints_are_content_hashes():
    assert fingerprint(None) == ABSENT and fingerprint("/no/such/path") == ABSENT
    assert params_hash({"a": 1, "b": [1.0, float("nan")]}) == params_hash({"b": [1.0, float("nan")], "a": 1})
    assert params_hash({"a": 1}) != params_hash({"a": 2})


def test_commit_refuses_missing_outputs_and_damaged_manifests_mean_rerun(tmp_path):
    record = StageRecord(tmp_path / "m.json", "s", {}, {})
    with pytest.raises(ManifestError, match=r"stage s: cannot commit, outputs missing: table \(.*nope.parquet\)"):
        record.commit({"table": tmp_path / "nope.parquet"})
    (tmp_path / "m.json").write_text("{not json")
    assert record.completed() is None
    (tmp_path / "m.json").write_text(json.dumps({"version": 999}))
    assert record.completed() is None


def test_failpoints_select_the_nth_visit_and_trace_every_visit(tmp_path, monkeypatch):
    assert _selects("write_table:steps.parquet:published@2", "write_table:steps.parquet:published", 2)
    assert not _selects("write_table:steps.parquet:published@2", "write_table:steps.parquet:published", 1)
    assert _selects("engine:generate", "engine:generate", 1) and not _selects("engine:generate", "engine:other", 1)
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace"))
    failpoint("unit:a")
    failpoint("unit:b")
    assert (tmp_path / "trace").read_text().split() == ["unit:a", "unit:b"]


def _manifest_times(run) -> dict[str, int]:
    return {str(p.relative_to(run.run_dir)): p.stat().st_mtime_ns for p in run.run_dir.glob("**/_manifests/*.json")}


def test_a_rerun_skips_completed_stages_and_a_changed_config_reruns_what_it_affects(tmp_path):
    overrides = [f"data_root={tmp_path}", "run_id=resumed", "dev_eval.every=0", "trainer.entropy_coef=0.05",
                 "rollout.straggler_wait_s=.inf"]
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml", overrides)
    first = train(config)
    run = DataRoot(tmp_path).run("resumed")
    done = _manifest_times(run)
    assert "iteration=1/_manifests/train.json" in done and "_manifests/init_policy.json" in done

    again = train(config)
    assert _manifest_times(run) == done  # nothing redone: every manifest untouched
    assert again.model_version == first.model_version == 2  # and no model registered twice

    # issue 29: a truncated steps table redoes its rollout and what read it, and ends as it was
    tables = snapshot(tmp_path, "resumed")
    steps = Path(run.table_uri(0, "steps"))
    steps.write_bytes(steps.read_bytes()[:1000])
    repaired = train(config)
    after = _manifest_times(run)
    assert sorted(name for name in done if after[name] != done[name]) == [
        f"iteration=0/_manifests/{stage}.json"
        for stage in ("audit", "compute_advantages", "label_rewards", "log_iteration", "prune", "rollout", "train")] + [
        "iteration=1/_manifests/audit.json"]  # the audit of iteration k reads iterations 0..k
    # the redone training wrote iteration 0's checkpoint again; its prune (rerun: a new train manifest) took it again
    assert not run.checkpoint_dir(0).exists() and read_tombstone(run.checkpoint_dir(0)) is not None
    assert snapshot(tmp_path, "resumed") == tables and repaired.model_version == 2
    done = after

    changed = train(load_config(REPO_ROOT / "configs" / "tiny.yaml", [*overrides, "trainer.lr=1e-3"]))
    after = _manifest_times(run)
    redone = sorted(name for name in done if after[name] != done[name])
    # iteration 0's data and rollout are upstream of training; everything after its update reruns
    assert redone == ["iteration=0/_manifests/audit.json", "iteration=0/_manifests/log_iteration.json",
                      "iteration=0/_manifests/prune.json", "iteration=0/_manifests/train.json",
                      "iteration=1/_manifests/audit.json", "iteration=1/_manifests/compute_advantages.json",
                      "iteration=1/_manifests/label_rewards.json", "iteration=1/_manifests/log_iteration.json",
                      "iteration=1/_manifests/prune.json", "iteration=1/_manifests/rollout.json",
                      "iteration=1/_manifests/train.json"]
    assert changed.model_version == 2


def test_resume_of_an_unknown_run_and_of_a_run_in_use_fail_clearly(tmp_path, capsys):
    from agent_core.io.locks import run_lock
    from flows.cli import main as cli_main

    assert cli_main(["resume", "--run-id", "nope", "--data-root", str(tmp_path)]) == 2
    assert "run 'nope' has no config at" in capsys.readouterr().err
    run = DataRoot(tmp_path).run("busy")
    with run_lock(run.lock_path, "busy"):  # as if another process were training it
        assert cli_main(["train", "--config", str(REPO_ROOT / "configs" / "tiny.yaml"), "--run-id", "busy",
                         "--data-root", str(tmp_path)]) == 2
    assert "run 'busy' is being written by another process (pid" in capsys.readouterr().err
    assert not run.config_path.exists()  # refused before writing anything
