"""runtime.background_save: the optimizer state and the train stage's manifest are written on the
writer thread (agent_core/io/background.py) while the flow goes on; the same files as a synchronous
save, the stage committed only after them, a failed write never committed and always reported.
Tiny real Llamas on real tables (the helpers of test_resident_policy)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import agent_core.training.iteration as iteration
from agent_core.io import background
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import read_manifest
from agent_core.io.run_status import run_status
from agent_core.training import resident
from tasks.run_config import recording_end
from test_resident_policy import _assert_same, _outputs, _tables, _train, policy_dir  # noqa: F401 - a fixture

LABELS = ["iteration 0: optimizer state", "iteration 0: train manifest"]


@pytest.fixture(autouse=True)
def clean_writer():
    resident.forget()
    yield
    background.wait_quietly()  # a test that failed half-way leaves nothing running into the next
    resident.forget()


@pytest.fixture()
def held_writes(monkeypatch) -> threading.Event:
    """Optimizer-state writes block until the returned event is set."""
    release = threading.Event()
    real = iteration.save_optimizer_state

    def held(*args, **kwargs):
        assert release.wait(timeout=60), "the test never released the write"
        return real(*args, **kwargs)

    monkeypatch.setattr(iteration, "save_optimizer_state", held)
    return release


def test_jobs_run_in_order_and_after_a_failure_none_runs_and_the_failure_is_reported_once():
    done: list[str] = []
    background.submit("first", lambda: done.append("first"))
    background.submit("broken", lambda: (_ for _ in ()).throw(OSError("disk full")))
    background.submit("after", lambda: done.append("after"))
    with pytest.raises(background.BackgroundWriteError, match="broken: OSError: disk full") as caught:
        background.wait()
    assert isinstance(caught.value.__cause__, OSError)
    assert done == ["first"]  # "after" was not run: it may depend on what "broken" should have written
    background.wait()  # reported once; the queue is clean
    background.submit("later", lambda: done.append("later"))
    background.wait()
    assert done == ["first", "later"]


def test_the_stage_returns_before_its_optimizer_state_is_written_and_is_committed_after_it(tmp_path, policy_dir,
                                                                                            held_writes):
    run = RunLayout(tmp_path, "r1")
    _tables(run, 0, "grpo")
    checkpoint = _train(run, 0, policy_dir, "grpo", keep=True, settle=False)  # background_save: the default
    assert Path(checkpoint, "model.safetensors").is_file()  # what the next rollout reads is there
    assert not run.optimizer_state_path(0).exists()
    assert read_manifest(run.manifest_path("train", 0)) is None  # not complete for a resume yet
    assert background.pending() == LABELS
    held_writes.set()
    background.wait()
    assert run.optimizer_state_path(0).is_file()
    assert set(read_manifest(run.manifest_path("train", 0)).outputs) == {"checkpoint", "optimizer", "train_metrics"}
    assert resident.held(resident.POLICY) is not None  # stamped after the write, so the next iteration takes it


def test_switched_off_everything_is_written_before_the_stage_returns(tmp_path, policy_dir, held_writes):
    held_writes.set()
    run = RunLayout(tmp_path, "r1")
    _tables(run, 0, "grpo")
    _train(run, 0, policy_dir, "grpo", keep=True, settle=False, background_save=False)
    assert background.pending() == []
    assert run.optimizer_state_path(0).is_file() and read_manifest(run.manifest_path("train", 0)) is not None


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_background_and_synchronous_saves_write_the_same_files(tmp_path, policy_dir, estimator):
    runs = {}
    for later in (False, True):
        run = runs[later] = RunLayout(tmp_path / str(later), "r1")
        policy = policy_dir
        for k in (0, 1):
            _tables(run, k, estimator)
            policy = Path(_train(run, k, policy, estimator, keep=True, settle=False, background_save=later))
        background.wait()
    for k in (0, 1):
        _assert_same(_outputs(runs[False], k, estimator == "gae"), _outputs(runs[True], k, estimator == "gae"),
                     f"iteration {k}")
        fingerprints = [read_manifest(r.manifest_path("train", k)).output_fingerprints for r in runs.values()]
        for output in ("checkpoint", "optimizer"):  # train_metrics holds timings
            assert fingerprints[0][output] == fingerprints[1][output], output


def test_a_failed_write_leaves_the_stage_uncommitted_and_stops_the_next_training(tmp_path, policy_dir, monkeypatch):
    def full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(iteration, "save_optimizer_state", full)
    run = RunLayout(tmp_path, "r1")
    for k in (0, 1):
        _tables(run, k, "grpo")
    checkpoint = _train(run, 0, policy_dir, "grpo", keep=True, settle=False)
    with pytest.raises(background.BackgroundWriteError, match="iteration 0: optimizer state: OSError: No space"):
        _train(run, 1, Path(checkpoint), "grpo", keep=True, settle=False)
    assert read_manifest(run.manifest_path("train", 0)) is None  # a resume redoes iteration 0's training
    assert not run.checkpoint_dir(1).exists()


def test_a_run_whose_last_write_fails_is_recorded_as_failed(tmp_path):
    run = RunLayout(tmp_path, "r1")
    with pytest.raises(background.BackgroundWriteError):
        with recording_end(run):
            background.submit("iteration 2: optimizer state", lambda: (_ for _ in ()).throw(OSError("EIO")))
    status = run_status(run)
    assert status.status == "failed" and "iteration 2: optimizer state" in status.detail
