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


# --- which iterations log_iteration registers (tracking.register_every) ---------------------------


def _log_iterations(tracker: Tracker, store: Path, tmp_path: Path, monkeypatch, run_id: str, dev_ems: list[float],
                    register_every: int) -> tuple[str, list, str]:
    """tasks.track.log_iteration over len(dev_ems) iterations of one run (summaries stubbed: only the
    dev EM matters here); returns the model name, the iteration reports and the MLflow run id."""
    import dataclasses

    import tasks.track as track
    from agent_core.io.layout import RunLayout
    from agent_core.io.summaries import IterationSummary

    def summary(run, k):
        zeros = {field.name: 0 for field in dataclasses.fields(IterationSummary)}
        return IterationSummary(**{**zeros, "iteration": k, "dev_em": dev_ems[k], "dev_f1": dev_ems[k]})

    monkeypatch.setattr(track, "iteration_summary", summary)
    model = f"policy-{run_id}"
    ref = track.TrackingRef(tracker.tracking_uri, (store / "artifacts").as_uri(), tracker.experiment_name,
                            tracker.start_run(run_id, {}), model, "grpo", register_every, len(dev_ems))
    run = RunLayout(tmp_path, run_id)
    reports = [track.log_iteration.fn(run, k, ref, str(_checkpoint(tmp_path, f"ckpt{k}", b"w%d" % k)))
               for k in range(len(dev_ems))]
    return model, reports, ref.mlflow_run_id


def _registered_iterations(tracker: Tracker, model: str) -> dict[int, int]:
    return {int(v.tags["iteration"]): int(v.version) for v in tracker.client.search_model_versions(f"name = '{model}'")}


def test_every_second_iteration_and_the_last_are_registered(tracker: Tracker, store: Path, tmp_path: Path,
                                                             monkeypatch):
    model, reports, mlflow_run_id = _log_iterations(tracker, store, tmp_path, monkeypatch, "every-2", [math.nan] * 3,
                                                    register_every=2)
    assert _registered_iterations(tracker, model) == {1: 1, 2: 2}
    assert [r.model_version for r in reports] == [None, 1, 2]
    assert tracker.client.get_model_version_by_alias(model, "latest").tags["iteration"] == "2"  # the final policy
    assert tracker.client.get_registered_model(model).aliases == {}  # nothing evaluated: no best
    assert sorted(m.step for m in tracker.client.get_metric_history(mlflow_run_id, "loss")) == [0, 1, 2]  # all logged


def test_an_iteration_with_the_best_dev_em_so_far_is_registered_so_best_stays_the_best(
        tracker: Tracker, store: Path, tmp_path: Path, monkeypatch):
    """Registering every iteration would point `best` at iteration 2 (0.3, the later of a tie): so must
    registering only the due ones (the last) and the new bests (0, and 2 by the tie)."""
    model, reports, _ = _log_iterations(tracker, store, tmp_path, monkeypatch, "every-10", [0.3, 0.2, 0.3, 0.1, 0.25],
                                        register_every=10)
    registered = _registered_iterations(tracker, model)
    assert registered == {0: 1, 2: 2, 4: 3}
    assert [r.model_version for r in reports] == [1, None, 2, None, 3]
    assert tracker.client.get_registered_model(model).aliases == {"best": registered[2]}
    assert tracker.client.get_model_version_by_alias(model, "latest").tags["iteration"] == "4"


def test_register_every_one_registers_every_iteration(tracker: Tracker, store: Path, tmp_path: Path, monkeypatch):
    model, _, _ = _log_iterations(tracker, store, tmp_path, monkeypatch, "every-1", [0.5, math.nan, 0.1],
                                  register_every=1)
    assert _registered_iterations(tracker, model) == {0: 1, 1: 2, 2: 3}
    assert tracker.client.get_registered_model(model).aliases == {"best": 1}
