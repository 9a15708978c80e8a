"""Tracker against a real MLflow SQLite store and local artifact folder (one store per module:
creating the store's schema costs a few seconds)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agent_core.io.model_registry import model_checkpoint_dir
from agent_core.io.tracking import (
    MAX_PARAM_VAL_LENGTH,
    RUN_ID_TAG,
    TRUNCATION_MARKER,
    Tracker,
    TrackingError,
    flatten_params,
    param_value,
)

# MLflow 3.17's SQLAlchemy store triggers this deprecation itself; nothing for us to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="module")
def tracker(store: Path) -> Tracker:
    # A file:// URI, as tasks/track.py passes it; plain paths are accepted too (see reuse test).
    return Tracker(f"sqlite:///{store / 'db' / 'mlflow.db'}", (store / "artifacts").as_uri())


def _checkpoint(tmp_path: Path, name: str, payload: bytes) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(payload)
    (directory / "config.json").write_text('{"hidden_size": 8}')
    (directory / "tokenizer.json").write_text("{}")  # registering copies files; it loads nothing
    return directory


def test_flatten_params_nests_with_dots_and_stringifies_non_scalars():
    config = {"algorithm": {"estimator": "grpo", "kl": {"coef": 0.1}}, "seed": 3, "tags": [1, 2], "x": None}
    assert flatten_params(config) == {
        "algorithm.estimator": "grpo",
        "algorithm.kl.coef": 0.1,
        "seed": 3,
        "tags": "[1, 2]",
        "x": None,
    }


def test_param_value_cuts_long_values_to_mlflow_limit_with_marker():
    assert param_value(0.5) == "0.5"
    cut = param_value("a" * (MAX_PARAM_VAL_LENGTH + 10))
    assert len(cut) == MAX_PARAM_VAL_LENGTH
    assert cut.endswith(TRUNCATION_MARKER)
    assert param_value("b" * MAX_PARAM_VAL_LENGTH) == "b" * MAX_PARAM_VAL_LENGTH


def test_start_run_twice_resumes_the_same_mlflow_run(tracker: Tracker):
    params = {"algorithm": {"estimator": "grpo"}, "lr": 3e-4, "long": "z" * (MAX_PARAM_VAL_LENGTH + 1)}
    first = tracker.start_run("run-a", params, tags={"owner": "tests"})
    second = tracker.start_run("run-a", params)
    other = tracker.start_run("run-b", {"lr": 1e-3})
    assert first == second != other
    run = tracker.client.get_run(first)
    assert run.data.tags[RUN_ID_TAG] == "run-a"
    assert run.data.tags["owner"] == "tests"
    assert run.data.params["algorithm.estimator"] == "grpo"
    assert run.data.params["lr"] == "0.0003"
    assert run.data.params["long"].endswith(TRUNCATION_MARKER)
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.`{RUN_ID_TAG}` = 'run-a'")
    assert len(runs) == 1


def test_start_run_adds_new_params_on_resume_and_refuses_changed_ones(tracker: Tracker):
    mlflow_run_id = tracker.start_run("run-c", {"seed": 1})
    assert tracker.start_run("run-c", {"seed": 1, "batch": 8}) == mlflow_run_id
    assert tracker.client.get_run(mlflow_run_id).data.params == {"seed": "1", "batch": "8"}
    with pytest.raises(TrackingError, match="'seed'.*'1'.*'2'"):
        tracker.start_run("run-c", {"seed": 2})


def test_a_second_tracker_on_the_same_store_reuses_experiment_and_run(tracker: Tracker, store: Path):
    mlflow_run_id = tracker.start_run("run-d", {"seed": 1})
    again = Tracker(tracker.tracking_uri, str(store / "artifacts"))
    assert again.experiment_id == tracker.experiment_id
    assert again.start_run("run-d", {"seed": 1}) == mlflow_run_id


def test_metrics_logged_at_two_steps_read_back_without_the_ones_that_do_not_apply(tracker: Tracker):
    mlflow_run_id = tracker.start_run("run-metrics", {})
    tracker.log_metrics(mlflow_run_id, {"loss": 1.5, "reward/mean": 0.25}, step=0)
    logged = tracker.log_metrics(mlflow_run_id, {"loss": 0.75, "reward/mean": float("nan"), "vf": math.inf}, step=1)
    assert logged == {"loss": 0.75}
    loss = sorted((m.step, m.value) for m in tracker.client.get_metric_history(mlflow_run_id, "loss"))
    assert loss == [(0, 1.5), (1, 0.75)]
    reward = {m.step: m.value for m in tracker.client.get_metric_history(mlflow_run_id, "reward/mean")}
    assert reward == {0: 0.25}  # NaN at step 1: not applicable, not logged
    assert tracker.client.get_metric_history(mlflow_run_id, "vf") == []


def test_a_metric_is_logged_once_per_step(tracker: Tracker):
    mlflow_run_id = tracker.start_run("run-once", {})
    tracker.log_metrics(mlflow_run_id, {"loss": 1.5}, step=0)
    assert tracker.log_metrics(mlflow_run_id, {"loss": 9.0, "em": 0.5}, step=0) == {"em": 0.5}  # a resumed log
    tracker.log_metrics(mlflow_run_id, {"loss": 0.5}, step=1)
    history = sorted((m.step, m.value) for m in tracker.client.get_metric_history(mlflow_run_id, "loss"))
    assert history == [(0, 1.5), (1, 0.5)]


def test_register_checkpoint_is_idempotent_and_numbers_iterations(tracker: Tracker, tmp_path: Path):
    mlflow_run_id = tracker.start_run("run-ckpt", {})
    ckpt0 = _checkpoint(tmp_path, "ckpt0", b"weights-0")
    ckpt1 = _checkpoint(tmp_path, "ckpt1", b"weights-1")

    v0 = tracker.register_checkpoint(mlflow_run_id, ckpt0, "policy-ckpt-test", iteration=0)
    v0_again = tracker.register_checkpoint(mlflow_run_id, ckpt0, "policy-ckpt-test", iteration=0)
    v1 = tracker.register_checkpoint(mlflow_run_id, ckpt1, "policy-ckpt-test", iteration=1)

    assert v0 == v0_again
    assert (v0.version, v1.version) == (1, 2)
    versions = tracker.client.search_model_versions("name = 'policy-ckpt-test'")
    assert sorted((int(v.version), v.tags["iteration"], v.run_id) for v in versions) == [
        (1, "0", mlflow_run_id),
        (2, "1", mlflow_run_id),
    ]
    for registered, payload in ((v0, b"weights-0"), (v1, b"weights-1")):
        assert registered.source.endswith(f"checkpoints/iteration={registered.version - 1}")
        model_dir = Path(registered.source.removeprefix("file://"))
        assert (model_dir / "MLmodel").is_file()  # a loadable MLflow model, the checkpoint its artifact
        on_disk = model_checkpoint_dir(model_dir)
        assert (on_disk / "model.safetensors").read_bytes() == payload
        assert (on_disk / "config.json").is_file()


def test_register_checkpoint_of_a_missing_directory_names_it(tracker: Tracker, tmp_path: Path):
    mlflow_run_id = tracker.start_run("run-missing", {})
    with pytest.raises(TrackingError, match="iteration 3.*nope"):
        tracker.register_checkpoint(mlflow_run_id, tmp_path / "nope", "policy-missing", iteration=3)


def test_log_text_and_artifacts_land_in_the_run_artifacts(tracker: Tracker, tmp_path: Path):
    mlflow_run_id = tracker.start_run("run-artifacts", {})
    report = tmp_path / "report"
    report.mkdir()
    (report / "summary.md").write_text("# EM 0.5\n")
    tracker.log_artifacts(mlflow_run_id, report, "report")
    tracker.log_text(mlflow_run_id, "hello", "notes/hello.txt")
    root = Path(tracker.client.get_run(mlflow_run_id).info.artifact_uri.removeprefix("file://"))
    assert (root / "report" / "summary.md").read_text() == "# EM 0.5\n"
    assert (root / "notes" / "hello.txt").read_text() == "hello"


def test_end_run_sets_status_and_resume_reopens_it(tracker: Tracker):
    mlflow_run_id = tracker.start_run("run-end", {})
    with pytest.raises(TrackingError, match="'DONE'.*FINISHED, FAILED, KILLED"):
        tracker.end_run(mlflow_run_id, status="DONE")
    tracker.end_run(mlflow_run_id, status="FAILED")
    assert tracker.client.get_run(mlflow_run_id).info.status == "FAILED"
    assert tracker.start_run("run-end", {}) == mlflow_run_id
    assert tracker.client.get_run(mlflow_run_id).info.status == "RUNNING"
    tracker.end_run(mlflow_run_id)
    assert tracker.client.get_run(mlflow_run_id).info.status == "FINISHED"
