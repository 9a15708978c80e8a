"""Registered versions cost no second copy, and pruning them keeps every listed version loadable (issue 56
item 2): a version's checkpoint files are hard links of the run's (same inodes, so `du` of the data root
grows by the model's metadata only), `prune_registered_versions` deletes one run's versions that are not
kept and their folders, never another run's, moves `best`, and survives a kill at each step (in process
and a real SIGKILL); after the runs' checkpoint folders are deleted, as retention does, every version
MLflow lists, `@best` and `@latest` still load.

Real tiny checkpoints (`save_policy`) against a real SQLite store and local artifact folder.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow.pyfunc
import pytest
from mlflow.models import Model

import agent_core.io.model_registry as model_registry
import agent_core.io.registry_retention as registry_retention
from agent_core.io.checkpoints import save_policy
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.model_registry import BEST_ALIAS, ITERATION_TAG, RUN_ID_TAG, model_checkpoint_dir, save_policy_model
from agent_core.io.registry_retention import PrunedVersion, prune_registered_versions
from agent_core.io.tracking import Tracker
from agent_core.training.model import build_tiny_policy, build_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent

# MLflow 3.17's SQLAlchemy store triggers this deprecation itself; nothing for us to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("registry-retention")


@pytest.fixture(scope="module")
def tracker(data_root: Path) -> Tracker:
    root = DataRoot(data_root)
    return Tracker(root.mlflow_tracking_uri, root.mlflow_artifacts.resolve().as_uri(), "retention-test")


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer(["who directed the film? <search>film</search> <answer>Ann Lee</answer>"] * 20,
                                vocab_size=300)
    return build_tiny_policy(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128), tokenizer


@pytest.fixture(autouse=True)
def registry_env(monkeypatch, tracker: Tracker):
    """mlflow.pyfunc.load_model resolves models:/ URIs in the process-wide registry URI."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.tracking_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracker.tracking_uri)


def _register(tracker: Tracker, policy, data_root: Path, run_id: str, model: str, dev_ems: dict[int, float | None]):
    """Run `run_id` saves a checkpoint per iteration where a run keeps it and registers it."""
    mlflow_run_id = tracker.start_run(run_id, {})
    run = RunLayout(data_root, run_id)
    return {k: tracker.register_checkpoint(mlflow_run_id, save_policy(*policy, run.checkpoint_dir(k)), model, k,
                                           dev_em=em, algorithm="grpo")
            for k, em in dev_ems.items()}


def _folder(registered) -> Path:
    return Path(registered.source.removeprefix("file://"))


def _du(*paths: Path) -> int:
    out = subprocess.run(["du", "-s", "-c", "--block-size=1", *map(str, paths)], capture_output=True, text=True,
                         check=True).stdout
    return int(out.splitlines()[-1].split()[0])


def _listed(tracker: Tracker, model: str) -> dict[int, tuple[str, str]]:
    """Version -> (pipeline run id, iteration) of every version MLflow lists."""
    return {int(v.version): (v.tags[RUN_ID_TAG], v.tags[ITERATION_TAG])
            for v in tracker.client.search_model_versions(f"name = '{model}'")}


def _all_load(tracker: Tracker, model: str) -> None:
    for version in _listed(tracker, model):
        mlflow.pyfunc.load_model(f"models:/{model}/{version}")
    for alias in (BEST_ALIAS, "latest"):
        texts = mlflow.pyfunc.load_model(f"models:/{model}@{alias}").predict("who directed", {"max_new_tokens": 4})
        assert len(texts) == 1 and isinstance(texts[0], str)


def test_a_registered_version_links_the_run_checkpoint_files_and_costs_only_its_metadata(tracker, policy, data_root):
    model = "links-policy"
    registered = _register(tracker, policy, data_root, "links-a", model, {0: 0.5, 1: 0.25})
    run = RunLayout(data_root, "links-a")
    for k, version in registered.items():
        shipped = model_checkpoint_dir(_folder(version))
        assert shipped == _folder(version) / "artifacts" / "checkpoint"
        names = sorted(p.name for p in run.checkpoint_dir(k).iterdir())
        assert sorted(p.name for p in shipped.iterdir()) == names
        for name in names:
            ours, theirs = (shipped / name).stat(), (run.checkpoint_dir(k) / name).stat()
            assert (ours.st_ino, ours.st_nlink) == (theirs.st_ino, 2), name
    checkpoints = _du(run.checkpoint_dir(0), run.checkpoint_dir(1))
    models = _du(run.checkpoint_dir(0), run.checkpoint_dir(1), _folder(registered[0]), _folder(registered[1])) - checkpoints
    assert checkpoints > 500_000 and models < 100_000, (checkpoints, models)  # a copy would add `checkpoints`
    # the MLmodel names the checkpoint it was made from and the model's size, not the placeholder's
    meta = Model.load(str(_folder(registered[0])))
    assert meta.flavors["python_function"]["artifacts"]["checkpoint"]["uri"] == str(run.checkpoint_dir(0))
    assert meta.model_size_bytes > sum(p.stat().st_size for p in run.checkpoint_dir(0).iterdir())
    _all_load(tracker, model)


def test_without_hard_links_the_checkpoint_is_copied_and_still_loads(policy, tmp_path, monkeypatch):
    checkpoint = save_policy(*policy, tmp_path / "run" / "checkpoint")

    def refused(source, target, **_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(model_registry.os, "link", refused)
    shipped = model_checkpoint_dir(save_policy_model(checkpoint, tmp_path / "model"))
    assert (shipped / "model.safetensors").read_bytes() == (checkpoint / "model.safetensors").read_bytes()
    assert (shipped / "model.safetensors").stat().st_nlink == 1
    assert mlflow.pyfunc.load_model(str(tmp_path / "model")).predict("who", {"max_new_tokens": 2})


def test_a_kill_before_the_model_is_renamed_in_leaves_no_half_model_and_a_rerun_registers_once(
        tracker, policy, data_root, monkeypatch):
    model = "staged-policy"
    mlflow_run_id = tracker.start_run("staged-a", {})
    checkpoint = save_policy(*policy, RunLayout(data_root, "staged-a").checkpoint_dir(0))

    def killed(point: str) -> None:
        if point == "registry:model_staged":
            raise SystemExit("killed")

    with monkeypatch.context() as patched, pytest.raises(SystemExit):
        patched.setattr(model_registry, "failpoint", killed)
        tracker.register_checkpoint(mlflow_run_id, checkpoint, model, 0)
    artifacts = Path(tracker.client.get_run(mlflow_run_id).info.artifact_uri.removeprefix("file://")) / "checkpoints"
    assert sorted(p.name for p in artifacts.iterdir()) == []  # no half model, and no staging left
    (artifacts / ".iteration=0.tmp-0123abcd").mkdir()  # what a SIGKILL there leaves: swept by the next try
    first = tracker.register_checkpoint(mlflow_run_id, checkpoint, model, 0)
    assert sorted(p.name for p in artifacts.iterdir()) == ["iteration=0"] and _listed(tracker, model) == {1: ("staged-a", "0")}
    assert tracker.register_checkpoint(mlflow_run_id, checkpoint, model, 0) == first


@pytest.fixture
def two_runs(tracker, policy, data_root):
    """A model with run A's iterations 0-3 (dev EM 0.2, 0.6, 0.4, not evaluated: best = A's 1) and run B's
    0-1 (0.1, 0.3); each test its own model name."""
    def make(model: str):
        a = _register(tracker, policy, data_root, f"{model}-a", model, {0: 0.2, 1: 0.6, 2: 0.4, 3: None})
        b = _register(tracker, policy, data_root, f"{model}-b", model, {0: 0.1, 1: 0.3})
        return a, b
    return make


def test_pruning_deletes_one_runs_unkept_versions_and_files_and_every_listed_version_loads(
        tracker, data_root, two_runs):
    model = "prune-policy"
    a, b = two_runs(model)
    shutil.rmtree(RunLayout(data_root, f"{model}-a").checkpoint_dir(0))  # retention already pruned iteration 0
    kept_files = {p: p.stat().st_ino for v in b.values() for p in _folder(v).rglob("*")}

    planned = prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {1, 3}, dry_run=True)
    assert [(p.version, p.iteration, p.path) for p in planned] == [
        (a[0].version, 0, _folder(a[0]).resolve()), (a[2].version, 2, _folder(a[2]).resolve())]
    assert len(_listed(tracker, model)) == 6 and _folder(a[0]).is_dir()  # a dry run changes nothing

    size = sum(p.stat().st_size for p in _folder(a[0]).rglob("*") if p.is_file())
    pruned = prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {1, 3})
    assert pruned == planned and all(isinstance(p, PrunedVersion) for p in pruned)
    assert pruned[0].bytes_freed == size  # its checkpoint's only other name was deleted
    assert 0 < pruned[1].bytes_freed < 100_000  # the run still holds its weights: only the metadata is freed
    assert _listed(tracker, model) == {a[1].version: (f"{model}-a", "1"), a[3].version: (f"{model}-a", "3"),
                                       b[0].version: (f"{model}-b", "0"), b[1].version: (f"{model}-b", "1")}
    assert not _folder(a[0]).exists() and not _folder(a[2]).exists()
    assert sorted(p.name for p in _folder(a[1]).parent.iterdir()) == ["iteration=1", "iteration=3"]  # no leftovers
    assert {p: p.stat().st_ino for v in b.values() for p in _folder(v).rglob("*")} == kept_files  # B untouched
    assert tracker.client.get_registered_model(model).aliases == {BEST_ALIAS: a[1].version}
    assert prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {1, 3}) == []  # idempotent
    _all_load(tracker, model)

    # the best goes too: `best` moves to the best version left, and everything left still loads
    prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {3})
    assert tracker.client.get_registered_model(model).aliases == {BEST_ALIAS: b[1].version}
    for run_id in (f"{model}-a", f"{model}-b"):  # retention deletes the runs' checkpoint folders
        shutil.rmtree(RunLayout(data_root, run_id).run_dir)
    _all_load(tracker, model)


@pytest.mark.parametrize("point", ["registry:versions_deleted", "registry:folder_hidden"])
def test_a_prune_killed_between_its_steps_is_finished_by_the_rerun(tracker, data_root, two_runs, monkeypatch, point):
    model = f"killed-{point.split(':')[1].replace('_', '-')}"
    a, _ = two_runs(model)

    def killed(reached: str) -> None:
        if reached == point:
            raise SystemExit("killed")

    with monkeypatch.context() as patched, pytest.raises(SystemExit):
        patched.setattr(registry_retention, "failpoint", killed)
        prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {3})
    assert len(_listed(tracker, model)) == 3  # versions go first: every listed version still has its files
    _all_load(tracker, model)
    again = prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {3})
    assert again and all(p.version is None for p in again)  # what the kill left: folders without a version
    assert sorted(p.name for p in _folder(a[3]).parent.iterdir()) == ["iteration=3"]
    assert prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {3}) == []
    _all_load(tracker, model)


_PRUNE = """
import sys
from agent_core.io.registry_retention import prune_registered_versions
prune_registered_versions(sys.argv[1], sys.argv[2], sys.argv[3], {3})
"""


@pytest.mark.slow  # a child process importing MLflow: ~6 s
def test_a_prune_sigkilled_after_hiding_a_folder_is_finished_by_the_rerun(tracker, data_root, two_runs):
    model = "sigkill-policy"
    a, _ = two_runs(model)
    env = {**os.environ, "AGENTR1_FAILPOINT": "registry:folder_hidden@2"}  # the second folder's deletion
    child = subprocess.run([sys.executable, "-c", _PRUNE, tracker.tracking_uri, model, f"{model}-a"], env=env,
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr
    left = sorted(p.name for p in _folder(a[3]).parent.iterdir())
    assert "iteration=3" in left and any(name.startswith(".iteration=1.pruned-") for name in left), left
    assert len(_listed(tracker, model)) == 3
    prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {3})
    assert sorted(p.name for p in _folder(a[3]).parent.iterdir()) == ["iteration=3"]
    _all_load(tracker, model)


def test_a_remote_artifact_store_gets_a_copy_and_pruning_leaves_its_files_alone(tracker, two_runs, monkeypatch):
    """A store that is not a local folder (any other artifact repository): the model goes through a
    temporary folder (a copy), and pruning deletes its versions but no files (path None, 0 bytes)."""
    import agent_core.io.tracking as tracking

    class Remote:  # nothing is an instance of it: every repository counts as remote
        pass

    monkeypatch.setattr(tracking, "LocalArtifactRepository", Remote)
    monkeypatch.setattr(registry_retention, "LocalArtifactRepository", Remote)
    model = "remote-policy"
    a, b = two_runs(model)
    shipped = model_checkpoint_dir(_folder(a[0])) / "model.safetensors"
    assert shipped.stat().st_nlink == 1  # copied by the repository's log_artifacts
    pruned = prune_registered_versions(tracker.tracking_uri, model, f"{model}-a", {3})
    assert [(p.iteration, p.path, p.bytes_freed) for p in pruned] == [(0, None, 0), (1, None, 0), (2, None, 0)]
    assert shipped.is_file() and len(_listed(tracker, model)) == 3
    assert tracker.client.get_registered_model(model).aliases == {BEST_ALIAS: b[1].version}
