"""Stage manifests and resume: when a stage counts as complete, and what a rerun redoes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_core.config import TrainerConfig
from agent_core.failpoints import TRACE_ENV, _selects, failpoint
from agent_core.io.layout import DataRoot
from agent_core.io.manifests import ABSENT, ManifestError, StageRecord, fingerprint, params_hash
from agent_core.validation import load_config
from flows.train import train

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


@pytest.mark.parametrize("change", ["params", "config field", "input content", "input gone", "output edited",
                                    "output deleted", "file added to the output folder"])
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
    else:
        (out_dir / "extra.bin").write_text("x")
    assert record(params).completed() is None


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

    changed = train(load_config(REPO_ROOT / "configs" / "tiny.yaml", [*overrides, "trainer.lr=1e-3"]))
    after = _manifest_times(run)
    redone = sorted(name for name in done if after[name] != done[name])
    # iteration 0's data and rollout are upstream of training; everything after its update reruns
    assert redone == ["iteration=0/_manifests/log_iteration.json", "iteration=0/_manifests/train.json",
                      "iteration=1/_manifests/compute_advantages.json", "iteration=1/_manifests/label_rewards.json",
                      "iteration=1/_manifests/log_iteration.json", "iteration=1/_manifests/rollout.json",
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
